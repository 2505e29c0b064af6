"""`pdserve bench`: an open-loop load generator for the pdserve gRPC endpoint.

datasets (what to send) -> arrivals (when) -> runner (send, time every token)
-> report (percentiles, throughput, goodput, hit rate) -> plots (PNG).
"""
