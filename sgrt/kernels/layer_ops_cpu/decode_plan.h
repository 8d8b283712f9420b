// The decode plan (decode_plan.cpp): torch.classes.sgrt_layer.DecodePlan, a model's whole decode
// step in one call.
#pragma once

#include <torch/library.h>

namespace [[gnu::visibility("hidden")]] sgrt_layer {

// Registers the DecodePlan class in library sgrt_layer (register.cpp's TORCH_LIBRARY calls it).
void register_decode_plan(torch::Library& m);

}  // namespace sgrt_layer
