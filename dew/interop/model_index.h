// A diffusers pipeline folder's model_index.json: the pipeline class and its components ([library, class] per
// name), read before any component loads. Torch-free: fuzzed alone (fuzz/model_index_fuzz.cpp).
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "dew/core/options.h"

namespace dew::interop::detail {

/// A JSON file of the folder; a missing or malformed one is a dew::Error naming it.
json read_pipeline_json(const std::filesystem::path& path);
/// DIR/model_index.json, checked before anything else: DIR a folder, the file valid JSON whose "_class_name" is one
/// of `accepted` (returned in `class_name`); otherwise a dew::Error naming the folder or file and what is accepted.
json read_model_index(const std::string& dir, const std::vector<std::string>& accepted, std::string& class_name);
/// The class DIR/model_index.json names, "" when the file is missing or not a JSON object with a string
/// "_class_name" (never an error: what the is_*_pipeline_folder tests ask).
std::string model_index_class(const std::string& dir);
/// model_index.json's entry for a component (["library", "Class"]): the class, "" when the entry or its class is
/// null; a missing entry or one of another shape is a dew::Error naming `file` and the component.
std::string index_component(const json& index, const std::string& name, const std::filesystem::path& file);
/// The component's class, which must be one of `accepted` ("" in accepted: the component may be null);
/// otherwise a dew::Error naming the file, the component and the accepted classes.
std::string expect_component(const json& index, const std::string& name, const std::vector<std::string>& accepted,
                             const std::filesystem::path& file);

}  // namespace dew::interop::detail
