"""What every experiment shares: the systems it compares (`systems`), the request-centric client
(`clients`), interleaved repeats with output checks (`measure`) and the result record (`record`); under
them, the machine a run measured on (`machine`), its command-line flags (`flags`), summaries of repeats
(`stats`), what it prints and writes (`output`) and the engine's model as baselines read it
(`engine_models`).

An experiment file (``benchmarks/<name>.py``) holds only what it compares: its sizes, its workload, the
systems and the ratios it reports.
"""
