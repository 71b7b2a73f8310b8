// What the attention and kv_write kernels hold a KV pool's entries as, for each XLA element
// type they are registered for.

#ifndef SPECJAX_CSRC_POOL_H_
#define SPECJAX_CSRC_POOL_H_

#include "vec8.h"
#include "xla/ffi/api/ffi.h"

namespace specjax {

template <xla::ffi::DataType D>
struct PoolElement;
template <>
struct PoolElement<xla::ffi::F32> {
  using type = float;
};
template <>
struct PoolElement<xla::ffi::BF16> {
  using type = BF16;
};

}  // namespace specjax

#endif  // SPECJAX_CSRC_POOL_H_
