// nemo-dcr CPU kernels: the fused delta pass, the codec's stream transforms and the
// receiver's scatter. Plain C ABI over raw pointers (loaded with ctypes), so the library
// does not depend on the torch C++ ABI and works with any torch >= 2.4.
//
// Conventions: `width` is the element size in bytes (1, 2, 4, 8); elements are raw bit
// patterns; positions are int32 (pos64 == 0) or int64 (pos64 != 0), sorted, strictly
// increasing. Every function that reads untrusted input validates it completely before
// it writes anything to a target tensor.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

// The library is one translation unit, laid out by stage in parts/ (each under the size
// rule of tests/test_layout.py); the order matters: a part sees what the parts before it define.
#include "parts/delta.h"
#include "parts/rans_gaps.h"
#include "parts/context_walk.h"
#include "parts/streams.h"
#include "parts/encode.h"
#include "parts/context_encode.h"
#include "parts/context_decode.h"
