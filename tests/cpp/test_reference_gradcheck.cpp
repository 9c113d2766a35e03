// The CPU reference's backward pass against central finite differences of its own forward pass, in float64, on a
// small member of the family with every residual branch non-trivial (perturbed init: non-zero conv2, FixUp scalars
// away from 0 and 1). Without PyTorch: the Python tests compare with torch.autograd separately.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kfuse/reference.h"

namespace kfuse {
namespace {

template <class T>
HostTensor<T> random_tensor(const Shape& shape, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  HostTensor<T> t(shape);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> d(lo, hi);
  for (auto& v : t.values()) v = static_cast<T>(d(rng));
  return t;
}

double loss(const EncoderParams<double>& p, const HostTensor<double>& x, const HostTensor<double>& r) {
  const HostTensor<double> y = reference_forward(p, x);
  double s = 0;
  for (int64_t i = 0; i < y.numel(); ++i) s += y[i] * r[i];
  return s;
}

struct GradCase {
  EncoderConfig config;
  Shape input;
};

class ReferenceGradcheck : public ::testing::TestWithParam<GradCase> {};

TEST_P(ReferenceGradcheck, MatchesCentralDifferences) {
  const GradCase& gc = GetParam();
  EncoderParams<double> p = EncoderParams<double>::perturbed_init(gc.config, 11);
  const HostTensor<double> x = random_tensor<double>(gc.input, 12, 0.0, 1.0);
  const HostTensor<double> r = random_tensor<double>(gc.config.output_shape(gc.input), 13);
  const ReferenceGradients<double> g = reference_backward(p, x, r, true);

  std::mt19937_64 rng(14);
  const double eps = 1e-5;
  int checked = 0;
  auto check = [&](double& v, double analytic, const std::string& what) {
    const double saved = v;
    v = saved + eps;
    const double up = loss(p, x, r);
    v = saved - eps;
    const double down = loss(p, x, r);
    v = saved;
    const double numeric = (up - down) / (2 * eps);
    EXPECT_NEAR(analytic, numeric, 1e-6 + 1e-5 * std::abs(numeric)) << what;
    ++checked;
  };
  for (size_t i = 0; i < p.size(); ++i) {
    HostTensor<double>& t = p.at(i);
    const std::string& name = p.specs()[i].name;
    const int samples = t.numel() == 1 ? 1 : 3;
    for (int s = 0; s < samples; ++s) {
      const int64_t e = std::uniform_int_distribution<int64_t>(0, t.numel() - 1)(rng);
      check(t[e], g.params.at(i)[e], name + "[" + std::to_string(e) + "]");
    }
  }
  HostTensor<double> xm = x;
  for (int s = 0; s < 4; ++s) {
    const int64_t e = std::uniform_int_distribution<int64_t>(0, xm.numel() - 1)(rng);
    const double saved = xm[e];
    xm[e] = saved + eps;
    const double up = loss(p, xm, r);
    xm[e] = saved - eps;
    const double down = loss(p, xm, r);
    xm[e] = saved;
    EXPECT_NEAR(g.input[e], (up - down) / (2 * eps), 1e-6 + 1e-5 * std::abs(g.input[e])) << "input[" << e << "]";
  }
  EXPECT_GT(checked, 40);
}

INSTANTIATE_TEST_SUITE_P(SmallNetworks, ReferenceGradcheck,
                         ::testing::Values(GradCase{{2, 16, {1, 1, 1, 1}}, {2, 2, 32, 32}},
                                           GradCase{{1, 16, {1, 2}}, {1, 1, 16, 32}}),
                         [](const ::testing::TestParamInfo<GradCase>& info) {
                           const EncoderConfig& c = info.param.config;
                           std::string name = "c" + std::to_string(c.in_channels) + "_stages" +
                                              std::to_string(c.layers.size()) + "_n" +
                                              std::to_string(info.param.input[0]);
                           return name;
                         });

TEST(Reference, FloatStorageTracksDouble) {
  const EncoderConfig c{3, 16, {1, 1, 1, 1}};
  const auto pd = EncoderParams<double>::perturbed_init(c, 21);
  EncoderParams<float> pf(c);
  for (size_t i = 0; i < pd.size(); ++i)
    for (int64_t e = 0; e < pd.at(i).numel(); ++e) pf.at(i)[e] = static_cast<float>(pd.at(i)[e]);
  const auto xd = random_tensor<double>({3, 3, 64, 32}, 22, 0.0, 1.0);
  HostTensor<float> xf(xd.shape());
  for (int64_t e = 0; e < xd.numel(); ++e) xf[e] = static_cast<float>(xd[e]);
  const auto yd = reference_forward(pd, xd);
  const auto yf = reference_forward(pf, xf);
  double num = 0, den = 0;
  for (int64_t e = 0; e < yd.numel(); ++e) {
    num += (yf[e] - yd[e]) * (yf[e] - yd[e]);
    den += yd[e] * yd[e];
  }
  ASSERT_GT(den, 0.0);
  EXPECT_LT(std::sqrt(num / den), 1e-5);
}

TEST(Reference, RejectsMisfitInputAndGradient) {
  const EncoderConfig c{3, 16, {1, 1, 1, 1}};
  const auto p = EncoderParams<float>::fixup_init(c, 1);
  EXPECT_THROW(reference_forward(p, HostTensor<float>({1, 2, 32, 32})), InvalidArgument);
  EXPECT_THROW(reference_forward(p, HostTensor<float>({1, 3, 40, 32})), InvalidArgument);
  EXPECT_THROW(reference_backward(p, HostTensor<float>({1, 3, 32, 32}), HostTensor<float>({1, 128, 2, 1})),
               InvalidArgument);
}

TEST(Reference, WithoutInputGradientLeavesItEmpty) {
  const EncoderConfig c{1, 16, {1, 1, 1, 1}};
  const auto p = EncoderParams<float>::perturbed_init(c, 1);
  const auto x = random_tensor<float>({1, 1, 32, 32}, 2, 0.0, 1.0);
  const auto dy = random_tensor<float>({1, 128, 1, 1}, 3);
  const auto without = reference_backward(p, x, dy, false);
  const auto with = reference_backward(p, x, dy, true);
  EXPECT_EQ(without.input.numel(), 0);
  EXPECT_EQ(with.input.shape(), x.shape());
  for (size_t i = 0; i < p.size(); ++i)
    EXPECT_EQ(without.params.at(i).values(), with.params.at(i).values()) << p.specs()[i].name;
}

}  // namespace
}  // namespace kfuse
