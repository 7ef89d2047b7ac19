#include "runtime_settings.h"

#include <cstdlib>
#include <cstring>

namespace flash_ext {
namespace {

bool env_is_one(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace

RuntimeSettings& runtime_settings() {
  static RuntimeSettings settings{{!env_is_one("FLASH_EXT_DISABLE_SM90")},
                                  {env_is_one("FLASH_EXT_DEBUG_POISON_SCRATCH")}};
  return settings;
}

namespace {
// Read when the library loads, so that a later change of the environment does not matter.
[[maybe_unused]] const RuntimeSettings& settings_at_load = runtime_settings();
}  // namespace

}  // namespace flash_ext
