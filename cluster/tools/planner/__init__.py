"""`pdserve plan`: KV capacity, tensor parallelism, KV transfer time and
prefill:decode pool sizing for a model. Pure arithmetic on metadata: importing
this package never imports torch. See docs/planner.md.
"""
