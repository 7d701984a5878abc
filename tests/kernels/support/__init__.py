"""Test support for ``kvpool.kernels`` (not shipped): the float64 reference
(``reference``), random paged-KV cases (``testing``) and the CPU emulator of the CUDA
source (``cuda_emulator``). Import as ``tests.kernels.support.<module>``: pytest puts the
repository root on ``sys.path`` (``pythonpath = ["."]``)."""
