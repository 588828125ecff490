"""Expert parallelism over several GPUs of one host (``--gpus N``): the process group, the step
message rank 0 broadcasts, the rank worker loop, the expert-parallel ``Experts`` wrapper, and the
processes rank 0 starts and supervises. Imports ``worker`` and ``moe_offload``, as ``worker`` may."""
