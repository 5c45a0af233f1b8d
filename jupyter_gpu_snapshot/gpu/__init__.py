"""The GPU layer: NVIDIA's CUDA checkpoint driver API, NVML, and what the engine and
hibernation do with them.

Its face is small, and only ``node/`` (``node/gpus.py``, ``node/local_engine.py``) uses it: the
engine's hook (``hook.CudaCheckpointHook``), hibernation's gpu tier (``sleep.GpuSleep``), a
kernel tree's CUDA state, its wake and its resume (``trees``), the GPUs' inventory
(``inventory.read_inventory``), a choice of GPUs for a restore (``remap``), and where CRIU's
CUDA plugin is installed (``broker.PluginInstall``). Nothing else calls the driver.
"""
