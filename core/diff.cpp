#include <retrace/diff.h>
#include <retrace/number.h>

#include <ATen/ops/all.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/view_as_real.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <sstream>

namespace retrace {

namespace {

template <typename U>
constexpr U sign_bit() {
  return static_cast<U>(U{1} << (sizeof(U) * 8 - 1));
}

// Maps float bits onto a line where adjacent representable values are adjacent integers and
// +0 == -0 (the usual sign-magnitude to two's-complement trick).
template <typename U>
__int128 ordered(U bits) {
  const U magnitude = bits & static_cast<U>(~sign_bit<U>());
  return (bits & sign_bit<U>()) ? -static_cast<__int128>(magnitude) : static_cast<__int128>(magnitude);
}

std::uint64_t distance(__int128 a, __int128 b) {
  const __int128 d = a > b ? a - b : b - a;
  return d > static_cast<__int128>(UINT64_MAX) ? UINT64_MAX : static_cast<std::uint64_t>(d);
}

void count(double v, NonFiniteCounts& c) {
  if (std::isnan(v)) ++c.nan;
  else if (std::isinf(v)) (v > 0 ? c.pos_inf : c.neg_inf)++;
}

// T: element type, U: unsigned integer of the same width, kFloat: whether T is floating.
template <typename T, typename U, bool kFloat>
void compare(const T* a, const T* b, std::int64_t n, DiffReport& r) {
  for (std::int64_t i = 0; i < n; ++i) {
    U ua, ub;
    std::memcpy(&ua, &a[i], sizeof(U));
    std::memcpy(&ub, &b[i], sizeof(U));
    double da = 0, db = 0;
    if constexpr (kFloat) {
      if constexpr (std::is_same_v<T, double>) {
        da = a[i];
        db = b[i];
      } else {
        da = static_cast<double>(static_cast<float>(a[i]));
        db = static_cast<double>(static_cast<float>(b[i]));
      }
      count(da, r.expected_nonfinite);
      count(db, r.actual_nonfinite);
    }
    if (ua == ub) continue;
    if constexpr (!kFloat) {
      da = static_cast<double>(a[i]);
      db = static_cast<double>(b[i]);
    }
    if (r.differing++ == 0) {
      r.first_index = i;
      r.first_expected = da;
      r.first_actual = db;
    }
    if constexpr (kFloat) {
      if (std::isfinite(da) && std::isfinite(db)) {
        r.max_abs_diff = std::max(r.max_abs_diff, std::fabs(da - db));
      } else {
        ++r.nonfinite_mismatches;
      }
      if (!std::isnan(da) && !std::isnan(db)) {
        r.max_ulp = std::max(r.max_ulp, distance(ordered(ua), ordered(ub)));
      }
    } else {
      r.max_abs_diff = std::max(r.max_abs_diff, std::fabs(da - db));
      r.max_ulp = std::max(r.max_ulp, distance(static_cast<__int128>(a[i]), static_cast<__int128>(b[i])));
    }
  }
}

// Elements we cannot interpret (float8 and other exotic dtypes): count differing elements by
// their bytes only.
void compare_raw(const std::uint8_t* a, const std::uint8_t* b, std::int64_t n, std::size_t width, DiffReport& r) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i * width, b + i * width, width) == 0) continue;
    if (r.differing++ == 0) r.first_index = i;
  }
}

std::string sizes_string(const std::vector<std::int64_t>& sizes) {
  std::string s = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  return s + "]";
}

std::string counts_string(const NonFiniteCounts& c) {
  return "nan=" + std::to_string(c.nan) + " +inf=" + std::to_string(c.pos_inf) + " -inf=" + std::to_string(c.neg_inf);
}

}  // namespace

DiffReport bitwise_diff(const at::Tensor& expected, const at::Tensor& actual) {
  DiffReport r;
  if (!expected.defined() || !actual.defined()) {
    r.mismatch = std::string("undefined tensor on the ") + (!expected.defined() ? "expected" : "actual") + " side";
    return r;
  }
  r.dtype = std::string(c10::toString(expected.scalar_type()));
  r.sizes = expected.sizes().vec();
  if (expected.scalar_type() != actual.scalar_type()) {
    r.mismatch = std::string("dtype differs: ") + c10::toString(expected.scalar_type()) + " vs " +
                 c10::toString(actual.scalar_type());
    return r;
  }
  if (expected.sizes() != actual.sizes()) {
    r.mismatch = "shape differs: " + sizes_string(expected.sizes().vec()) + " vs " + sizes_string(actual.sizes().vec());
    return r;
  }
  r.numel = expected.numel();
  auto host = [](const at::Tensor& t) {
    at::Tensor h = t.resolve_conj().resolve_neg();
    if (h.is_complex()) h = at::view_as_real(h);
    return h.cpu().contiguous();
  };
  const at::Tensor a = host(expected);
  const at::Tensor b = host(actual);
  const std::int64_t n = a.numel();
  switch (a.scalar_type()) {
#define RETRACE_FLOAT_CASE(ST, T, U)                                         \
  case at::ScalarType::ST:                                                   \
    compare<T, U, true>(a.const_data_ptr<T>(), b.const_data_ptr<T>(), n, r); \
    break;
#define RETRACE_INT_CASE(ST, T, U) \
  case at::ScalarType::ST: compare<T, U, false>(a.const_data_ptr<T>(), b.const_data_ptr<T>(), n, r); break;
    RETRACE_FLOAT_CASE(Float, float, std::uint32_t)
    RETRACE_FLOAT_CASE(Double, double, std::uint64_t)
    RETRACE_FLOAT_CASE(Half, c10::Half, std::uint16_t)
    RETRACE_FLOAT_CASE(BFloat16, c10::BFloat16, std::uint16_t)
    RETRACE_INT_CASE(Byte, std::uint8_t, std::uint8_t)
    RETRACE_INT_CASE(Char, std::int8_t, std::uint8_t)
    RETRACE_INT_CASE(Short, std::int16_t, std::uint16_t)
    RETRACE_INT_CASE(Int, std::int32_t, std::uint32_t)
    RETRACE_INT_CASE(Long, std::int64_t, std::uint64_t)
    RETRACE_INT_CASE(Bool, bool, std::uint8_t)
#undef RETRACE_FLOAT_CASE
#undef RETRACE_INT_CASE
    default:
      compare_raw(static_cast<const std::uint8_t*>(a.const_data_ptr()),
                  static_cast<const std::uint8_t*>(b.const_data_ptr()), n, a.element_size(), r);
  }
  if (r.first_index >= 0) {
    // Position in the compared (possibly view_as_real) tensor, reported in its shape.
    std::int64_t rest = r.first_index;
    r.first_position.assign(a.dim(), 0);
    for (std::int64_t d = a.dim() - 1; d >= 0; --d) {
      const std::int64_t size = a.size(d);
      r.first_position[d] = size ? rest % size : 0;
      rest = size ? rest / size : 0;
    }
  }
  return r;
}

namespace {

// No element of p[0..n) has every exponent bit set. Blocks of 4096 elements, each reduced
// without a branch, so a NaN early ends the read early. A block's loop has a constant trip count:
// GCC's -O2 vectorizes only loops that need no epilogue (its "very cheap" cost model), and the
// loop over a block of variable length had run one element at a time (bench/README.md).
template <class Bits>
bool exponents_finite(const void* data, std::int64_t n, Bits exponent) {
  constexpr std::int64_t kBlock = 4096;
  const auto* p = static_cast<const Bits*>(data);
  std::int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Bits hits = 0;  // non-zero when an element has every exponent bit set
    for (std::int64_t k = 0; k < kBlock; ++k) hits |= static_cast<Bits>((p[i + k] & exponent) == exponent);
    if (hits) return false;
  }
  for (; i < n; ++i) {
    if ((p[i] & exponent) == exponent) return false;
  }
  return true;
}

}  // namespace

bool all_finite(const at::Tensor& tensor) {
  if (!tensor.defined() || !tensor.is_floating_point() || tensor.numel() == 0) return true;
  if (tensor.is_cpu() && tensor.is_contiguous() && !tensor.is_neg()) {
    const void* p = tensor.const_data_ptr();
    const std::int64_t n = tensor.numel();
    switch (tensor.scalar_type()) {
      case at::kFloat: return exponents_finite<std::uint32_t>(p, n, 0x7f800000u);
      case at::kDouble: return exponents_finite<std::uint64_t>(p, n, 0x7ff0000000000000ull);
      case at::kHalf: return exponents_finite<std::uint16_t>(p, n, 0x7c00u);
      case at::kBFloat16: return exponents_finite<std::uint16_t>(p, n, 0x7f80u);
      default: break;
    }
  }
  return at::isfinite(tensor).all().item<bool>();
}

NonFiniteCounts count_nonfinite(const at::Tensor& tensor) {
  DiffReport r = bitwise_diff(tensor, tensor);
  return r.expected_nonfinite;
}

std::string DiffReport::summary() const {
  if (!comparable()) return "not comparable: " + mismatch;
  if (differing == 0) return "bitwise equal (" + std::to_string(numel) + " elements)";
  std::ostringstream os;
  os << std::setprecision(9) << differing << " of " << numel << " elements differ; first at "
     << sizes_string(first_position) << " expected " << number_text(first_expected, 9) << " got "
     << number_text(first_actual, 9) << "; max |diff| " << number_text(max_abs_diff, 9) << ", max " << max_ulp
     << " ULP";
  if (nonfinite_mismatches) os << ", " << nonfinite_mismatches << " non-finite mismatches";
  return os.str();
}

std::string DiffReport::to_string() const {
  std::ostringstream os;
  os << "dtype " << dtype << ", shape " << sizes_string(sizes) << "\n";
  os << "  " << summary() << "\n";
  if (comparable()) {
    os << "  expected: " << counts_string(expected_nonfinite) << "\n";
    os << "  actual:   " << counts_string(actual_nonfinite) << "\n";
  }
  return os.str();
}

}  // namespace retrace
