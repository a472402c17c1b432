"""What every experiment shares: the systems it compares (`systems`), the request-centric client
(`clients`), interleaved repeats with output checks (`measure`) and the result record (`record`).

An experiment file (``benchmarks/<name>.py``) holds only what it compares: its sizes, its workload, the
systems and the ratios it reports.
"""
