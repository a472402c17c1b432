"""Engines beyond the in-process one, and Mutel's decisions: remote engines over HTTP (`remote_engine`),
OpenAI-compatible upstreams (`openai_backend`), prefill/decode pairs (`disagg_engine`, `disagg_chat`, `mutel`,
`slo_admission`) and Ray-placed engines (`ray_engines`, `ray_vllm`). Each implements
`server.engine.interface.Engine`; the manager (`server.serve`) holds them in its `EngineRegistry`."""
