"""Run by build.py as `python compile_child.py SOURCE FOLDER NAME`: one build of the CUDA top-k with
torch's C++-extension tooling into FOLDER/NAME.so, in a process of its own so that the parent can
bound it and never imports a half-built library. The arch comes from TORCH_CUDA_ARCH_LIST."""

import sys

from torch.utils.cpp_extension import load

source, folder, name = sys.argv[1:]
load(name=name, sources=[source], build_directory=folder, extra_cuda_cflags=["-O3"], verbose=False)
