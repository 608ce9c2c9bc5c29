// bitsandbytes' NF4 code book, written once for the host (quant/nf4.h's nf4::code()) and the
// CUDA kernel's constant memory: QLoRA's NormalFloat values, quantiles of N(0, 1) scaled to
// [-1, 1] with an exact zero, in code order 0..15. A list, not an array, so that either side can
// initialise its own storage from it. No other header; nvcc (C++17) includes it too.
#pragma once

#define SHARDLM_NF4_CODE_VALUES                                                                    \
  -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f, \
      -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f,                    \
      0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f,      \
      0.5626170039176941f, 0.7229568362236023f, 1.0f
