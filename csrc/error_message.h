// Error messages of the torch-facing layer (csrc/api/), built without streaming numbers through std::ostream.
//
// Why: on the H200 machine (torch 2.11, extension built there) formatting a number through an
// ostream inside this extension crashed the process (SIGSEGV in std::ostream::_M_insert<double>,
// a libstdc++ locale-facet mismatch between the extension and torch's libraries), so every
// TORCH_CHECK message with a number in it turned a clear error into a crash. Numbers go through
// snprintf / std::to_string here instead; TORCH_CHECK then only streams the finished string.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace flash_ext::message {

inline std::string part(const std::string& s) { return s; }
inline std::string part(const char* s) { return s; }
inline std::string part(bool b) { return b ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
std::string part(T value) {
  return std::to_string(value);
}
inline std::string part(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}
inline std::string part(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}
inline std::string part(c10::ScalarType type) { return c10::toString(type); }
inline std::string part(const c10::Device& device) { return device.str(); }

template <typename... Parts>
std::string concat(const Parts&... parts) {
  return (std::string() + ... + part(parts));
}

}  // namespace flash_ext::message

// TORCH_CHECK with a message assembled by flash_ext::message::concat.
#define FLASH_EXT_CHECK(cond, ...) TORCH_CHECK(cond, ::flash_ext::message::concat(__VA_ARGS__))
