"""The contracts shared by processes (router and workers): OpenAI request schemas and errors, HTTP
headers and the app skeleton, block hashes, the worker config and the tokenizer. Imports no torch, so
the router, which needs only these, starts in a fraction of a worker's time and memory."""
