"""The autoscaling simulator: a discrete-event model of the fleet (router, queues, prefill and decode
replicas, start-up, drain, burst absorption) driving the policies' own ``decide`` on a simulated clock.
Imports no kopf."""
