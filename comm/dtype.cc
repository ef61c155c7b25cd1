#include "comm/dtype.h"

namespace tpserve {

size_t DataTypeSize(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return 4;
    case DataType::kBFloat16:
      return 2;
    case DataType::kFloat8E4M3:
      return 1;
    case DataType::kFloat8E5M2:
      return 1;
    case DataType::kInt32:
      return 4;
    case DataType::kInt64:
      return 8;
    case DataType::kUInt8:
      return 1;
  }
  return 0;
}

std::string_view DataTypeName(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return "f32";
    case DataType::kBFloat16:
      return "bf16";
    case DataType::kFloat8E4M3:
      return "fp8_e4m3";
    case DataType::kFloat8E5M2:
      return "fp8_e5m2";
    case DataType::kInt32:
      return "i32";
    case DataType::kInt64:
      return "i64";
    case DataType::kUInt8:
      return "u8";
  }
  return "unknown";
}

}  // namespace tpserve
