"""mpihybrid: hybrid pipeline + data-parallel training over MPI.

mpiexec -n 4 mpihybrid train                     # embedded default job
mpiexec -n 12 mpihybrid train jobs/seed_k3_d4.toml --trace runs/seed.h5
"""

__version__ = "0.1.0"

from mpihybrid._blas import choose_blas_core
from mpihybrid._threads import limit_blas_threads

limit_blas_threads()  # before anything imports numpy: one BLAS thread per core a rank owns
choose_blas_core()  # ... and the OpenBLAS kernels `mpihybrid bench blas --save` measured fastest
