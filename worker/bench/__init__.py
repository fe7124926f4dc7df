"""``tandem bench``: a load generator for OpenAI-compatible endpoints (``serve``), a performance-model
calibration against a running worker (``calibrate``), seeded trace generators (``trace``) and run
comparison (``compare``). Modelled on vLLM's ``vllm bench serve``; definitions in docs/architecture.md."""
