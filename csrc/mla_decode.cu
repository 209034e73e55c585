// placeholder, replaced by kernels
#include "mla_decode.h"
