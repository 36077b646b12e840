// The GPU entry points of checksum.cuh (transfer checksums, xxh3-64).
#include "checksum.cuh"

using namespace handoff;

extern "C" __global__ void __launch_bounds__(CHECKSUM_WARPS * 32)
    xxh3_ranges(const HashRangesParams p) {
    xxh3_ranges_body(p);
}

extern "C" __global__ void __launch_bounds__(CHECKSUM_WARPS * 32)
    page_checksums(const PageChecksumParams p) {
    page_checksums_body(p);
}
