// The C ABI's own entry points: the calling thread's last error and the ABI's version, which
// `kernels/cpu_binding.py` checks before it binds anything.
#include "common.h"

PARROT_API const char* parrot_last_error() { return parrot_cpu::last_error().c_str(); }

PARROT_API int parrot_abi_version() { return 1; }
