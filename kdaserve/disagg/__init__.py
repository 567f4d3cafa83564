"""KV connectors: move a request's MLA latent-KV blocks and KDA state between engine instances
(prefill/decode disaggregation).

Split as vLLM's connector API is: a scheduler side (base.ConnectorScheduler, pure Python, in
the scheduler's process: which requests load from a remote prefill, which finished requests are
held for a remote reader, the per-step metadata) and a worker side (base.ConnectorWorker, one
per rank: registers that rank's caches, runs the transfers, reports what finished). The core
scheduler calls the scheduler side through the interface only; the engine builds both
(factory.py). The NIXL connector (nixl/) pulls from the prefill instance (READ).
"""
