// Field lists that several nn options structs share, as rows for DEW_OPTIONS (dew/core/options.h): a field
// that every model of a kind has is declared and documented here, once.
#pragma once
#include "dew/core/options.h"

/// dtype, attention_impl and remat, in that order: how a model computes. `unit` ("block" or "layer") names
/// what remat recomputes.
#define DEW_COMPUTE_FIELDS(F, C, unit)                                                                 \
  C(dtype, "float32", ({"float32", "bfloat16", "float16"}), "compute dtype (parameters stay float32)") \
  C(attention_impl, "auto", ({"auto", "reference", "chunked", "sdpa"}), "attention implementation")    \
  F(bool, remat, false, "recompute " unit " activations in backward (gradient checkpointing)")

/// in_channels, num_classes and context_features, in that order: the input channels and the conditioning of an
/// image denoiser. `context_note` says what context_features may be (the MM-DiTs need text).
#define DEW_DENOISER_INPUT_FIELDS(F, context_default, context_note)                                    \
  F(int64_t, in_channels, 3, "channels of the input (4 for SD latents)")                               \
  F(int64_t, num_classes, 0, "label classes (0 = unconditional); label num_classes is the null class") \
  F(int64_t, context_features, context_default, "width of text context features (" context_note ")")
