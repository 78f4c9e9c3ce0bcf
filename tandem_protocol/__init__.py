"""What every part of Tandem shares, and nothing engine-specific: the page and frame format
(`pages`), the page stream's framing (`wire`), the model contract (`contract`, `model_dir`),
sampling parameters (`sampling`), handoff modes (`handoff`), errors (`errors`), the agent HTTP
client and its in-place page receiver (`client`, `page_receiver`), the streaming HTTP protocol
both servers use (`http_server`), mDNS records (`discovery`) and the cluster-key check (`auth`).

It imports no engine (torch, transformers, mlx, vllm, sglang) and no FastAPI app; the import
contracts in pyproject.toml hold it to that.
"""

# The engines an agent can host (engine_adapters.ADAPTERS maps each to its adapter class).
ENGINES = ("torch", "mlx", "vllm", "sglang")
