/* pccl native kernels: declarations shared by the C sources and the cffi build (cdef). */
int pccl_kernels_abi_version(void);
