#include "kernels.h"
int pccl_kernels_abi_version(void) { return 1; }
