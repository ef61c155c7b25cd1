// CudaModel's per-layer weight records, shared by its source files (engine/cuda_model.cc: the
// forward pass; engine/cuda_model_setup.cc: creation, weights and buffers). Not a public header.
#pragma once

#include <array>
#include <cstdint>

#include "comm/cuda_resources.h"
#include "engine/cuda_model.h"
#include "layers/quantize_kernels.h"

namespace tpserve {

struct CudaModel::Linear {
  DeviceBuffer w;
  DeviceBuffer scales;  // input (x) scale at 0, weight scale at 16 bytes (cuBLASLt alignment)
  int64_t n = 0, k = 0;
  // The whole weight [n, tp * k] for a layer whose knobs say full_weight (GatherWholeWeight).
  DeviceBuffer w_full;
  // FP8 input scaled per batch from its amax (LinearWeight::dynamic_input):
  // the forward pass writes x_scale before the layer reads it.
  bool dynamic = false;
  // FP8 scale scheme (CudaLinearShape::scale_scheme). kPerTensor: `scales` above. The finer
  // schemes: w_scales holds the weight's scales as the GEMM reads them (n floats, or
  // the 128x128 blocks at BlockwiseWeightScalePitch(k)), and the input is quantized for every
  // batch per row / 1x128 group, its scales in the model's a_scales_.
  GemmScaleScheme scheme = GemmScaleScheme::kPerTensor;
  DeviceBuffer w_scales;
  bool fine() const { return scheme != GemmScaleScheme::kPerTensor; }
  // How a fine layer's input is scaled: per row, or per 1x128 group (block-wise).
  Fp8ScaleGranularity granularity() const {
    return scheme == GemmScaleScheme::kBlockwise ? Fp8ScaleGranularity::kPerGroup128
                                                 : Fp8ScaleGranularity::kPerRow;
  }
  // Attention writes BF16 for QuantizeInput (which sets or computes the scales), not E4M3.
  bool staged() const { return dynamic || fine(); }
  const float* x_scale() const { return scales.as<float>(); }
  const float* w_scale() const { return scales.as<float>() + 4; }
};

struct CudaModel::Layer {
  DeviceBuffer input_norm, post_norm;  // BF16 [H]
  Linear qkv, o, gate_up, down;
  // The E4M3 KV cache's scales of this layer (LayerWeights::kv_scales), which E4M3 prefill
  // attention quantizes K and V with too.
  KvScales kv_scales;
  // By TpLayerShape::index (block order).
  Linear& at(int index) { return *std::array<Linear*, 4>{&qkv, &o, &gate_up, &down}[index]; }
  const Linear& at(int index) const { return const_cast<Layer*>(this)->at(index); }
};

}  // namespace tpserve
