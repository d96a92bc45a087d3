"""Measuring and predicting how pretraining scales.

- ``labkit.study.memory``: ``plan_model``, the largest micro-batch of any model on one rank,
  counted (state per rank as training holds it, activations, transients, FLOPs per token);
- ``labkit.study.counting``: the count behind it (saved tensors, the step's live peak, FLOPs),
  on fake or CPU tensors; ``labkit.study.cuda_like``: what a CUDA GPU keeps, counted on the CPU;
- ``labkit.study.plan``: the activation-memory formula that explains the count
  (``activation_terms``), model state under ZeRO, the memory plan of one GPU, and the one
  largest-micro-batch search (``largest_fitting``);
- ``labkit.study.parallel``: DP x TP x PP splits at the study's scale;
- ``labkit.study.gpu``: the planner against a real GPU (needs CUDA);
- ``labkit.study.scaling``: the data-parallel network model (bucketed ring all-reduce);
- ``labkit.study.laws``: scaling-law fits and compute-optimal allocation;
- ``labkit.study.loader_sweep``: DataLoader workers against a consumer of a planned step time;
- ``labkit.study.sweeps``: the sweeps over a cluster (re-exported by ``labkit.lab``);
- ``labkit.study.goodput``: the statistical goodput columns of the rank and batch sweeps;
- ``labkit.study.branching`` and ``branch_stats``: the critical batch during a run, by branching
  from its checkpoints, with bootstrap intervals.
"""
