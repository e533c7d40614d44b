"""The scheduling simulator: the real Scheduler and KVCacheManager on a virtual clock, with a cost model in place of
the model forward. Workloads (workload), step costs (cost_model), the event loop (simulator), metrics and plots
(report), fitting the cost model on the real engine (fit, replay), and `tokenmill simulate` (cli)."""
