"""Fleet simulator: pdserve's own router, schedulers and block managers on a
virtual clock, with per-node cost models instead of model executors.

- clock.py        `VirtualClock` (injected wherever engine/ and cluster/ read time)
- events.py       `EventLoop`: single-threaded discrete-event loop
- cost_model.py   `CostModel` interface, `TableCostModel` (JSON interpolation tables, optional
                  fitted step model), `ScaledCost` (a calibrated multiple of another model)
- step_fit.py     `StepFeatures` / `StepFit`: per-step overhead + per-sequence + per-token +
                  attention terms shaped like the CPU backend, fitted by non-negative least squares
- gpu_profiles.py analytic H100/A100-class tables from published figures
- workload.py     Mooncake traces, synthetic datasets, time compression, overlays
- node.py         `SimNode`: a real `Scheduler` with a null executor
- cluster_sim.py  `ClusterSim`: arrivals -> real `Router` -> prefill -> transfer -> decode
                  (pools can grow and drain while it runs; worker-hours)
- autoscale.py    `SimAutoscaler`: cluster/orchestration/autoscale's controller on the virtual
                  clock (signals from the nodes, optionally the TTFT wait-miss fraction, decisions
                  acted on via `ClusterSim`); `planned_split`: the planner's split of N to start at
- metrics.py      TTFT / ITL / e2e, goodput, hit rate, bytes, utilisation
- insitu.py       `Interference`: a shared host's step slowdown by how many other parties are
                  busy, and the frontend's cost, fitted from workers' step traces
                  (engine/step_trace.py); `SimNode.retime` applies it
- measure.py      `--measure`: time real engine steps (interleaved rounds, thread CPU time) into
                  a CPU cost table and its fit
- cli.py          `pdserve simulate`
- plots.py        PNG plots of sweeps
"""
