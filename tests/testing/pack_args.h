// PackArgs: a kernel's arguments packed at the offsets its backend::Function reports, as the
// worker's session layer packs them, for tests that launch through a backend directly. A
// count or size that does not match the parameters is a test failure.
#ifndef GPURPC_TESTS_TESTING_PACK_ARGS_H_
#define GPURPC_TESTS_TESTING_PACK_ARGS_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"
#include "server/worker/backend/backend.h"

namespace gpurpc::testing {

template <typename... Args>
std::vector<uint8_t> PackArgs(const backend::Function& function, Args... args) {
  const std::vector<backend::ParamInfo>& params = function.params();
  EXPECT_EQ(params.size(), sizeof...(Args));
  std::vector<uint8_t> packed(
      params.empty() ? 0 : params.back().offset_bytes + params.back().size_bytes);
  size_t index = 0;
  const auto put = [&](auto value) {
    if (index >= params.size()) return;
    const backend::ParamInfo& param = params[index++];
    EXPECT_EQ(param.size_bytes, sizeof(value));
    if (param.offset_bytes + sizeof(value) > packed.size()) {
      ADD_FAILURE() << "parameter past the packed size";
      return;
    }
    std::memcpy(packed.data() + param.offset_bytes, &value, sizeof(value));
  };
  (put(args), ...);
  return packed;
}

}  // namespace gpurpc::testing

#endif  // GPURPC_TESTS_TESTING_PACK_ARGS_H_
