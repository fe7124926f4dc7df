"""The SLO autoscaler: one policy engine fed by pods' /metrics, by Prometheus or by the simulator.

Imports no kopf. ``snapshot`` holds the input and output types every caller shares; the policy,
the metric sources and the actuators live beside it, one module each.
"""
