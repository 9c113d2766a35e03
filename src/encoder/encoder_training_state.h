// Internal: the training step's state (the stash and gradients per geometry, the backward's choices and scratch)
// and the helpers that the training forward (encoder_train.cpp) and the backward (encoder_backward.cpp) share.
// Not installed.
#pragma once

#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/encoder/weight_layout.h"
#include "encoder/backward_conv_selection.h"
#include "encoder/encoder_gpu_impl.h"

namespace kfuse {

using kernels::GradJob;

// The buffers of one training geometry: the forward's stash and the backward's gradients.
struct TrainBuffers {
  void* base = nullptr;
  Activations act;                               // forward: x0, a, h2, o (raw: conv2_raw), y (stash), idt (scratch)
  std::vector<void*> d_o, dh2, dcat, dz, dx;     // per block; dz only for identity blocks (else inside dcat)
  std::vector<float*> g1, g2;                    // KRSC weight-gradient sums (fp32, or T): conv1 [+ shortcut], conv2
  // Blocks whose forward runs conv1 as a cuDNN graph (act.h non-null): where fused_dgrad, conv2's data gradient and
  // the ReLU-mask backward are one cuDNN graph too, whose per-channel sums (2 x P floats) land in sums.
  std::vector<char> fused_dgrad;
  std::vector<float*> sums;
  // A device 0.0f: the ReLU-mask kernel's threshold where it reads h instead of h2 (set when the buffers are made,
  // so that no backward allocates or writes outside its stream).
  float* zero = nullptr;
  uint64_t stash = 0;                            // id of the forward whose values the buffers hold (0: none)
  int next_stage = 0;                            // a staged backward's next stage (backward_stage runs them in order)
  DType y_dtype = DType::F32;
};

struct BackwardPlanCache;  // encoder_backward.cpp

struct TrainingState {
  std::map<Geometry, TrainBuffers> buffers;
  uint64_t next_stash = 1;
  // Parameter order and flat-gradient offsets (parameter_specs order).
  std::unordered_map<std::string, size_t> index;
  std::vector<int64_t> grad_offset;
  std::vector<int64_t> param_numel;
  // Device job table of the gradients' layouts, re-uploaded only when its contents change.
  std::vector<GradJob> grad_jobs;
  GradJob* d_grad_jobs = nullptr;
  size_t grad_job_capacity = 0;
  // One scratch area for the backward's workspaces, in two equal halves: the main stream's launches use the first,
  // the weight-gradient branch's the second (the launches of one stream run one after another); then one area per
  // block for its squeeze-excite backward, whose two phases run on the two branches.
  void* scratch = nullptr;
  size_t scratch_bytes = 0;  // per half
  size_t se_scratch_bytes = 0;  // after the halves: one area per block for the squeeze-excite backward
  // The weight gradients run on a side branch (Impl::side): fork after the kernel that produces their dL/dout, one
  // join at the end of the step (events, which stream capture turns into parallel graph branches).
  // options.wgrad_branch false keeps everything on the main stream (the branch took a batch-2048 step from 3.008 to
  // 2.765 ms on H100).
  bool wgrad_branch = true;
  std::vector<cudaEvent_t> wgrad_fork;
  cudaEvent_t wgrad_join = nullptr;
  bool weights_from_device = false;
  // cuDNN graphs for conv1 + its FixUp epilogue and conv2's data gradient + the ReLU mask (kernels/conv/cudnn_fused.h):
  // options.cudnn_fused 1 (default) where the tuner runs conv1 in cuDNN anyway (it would pay a separate epilogue
  // pass), 2 in every block that cuDNN supports (for tests), 0 never (the graphs save ~85 us per batch-2048 step on
  // H100).
  enum class CudnnFused { kOff, kWhereCudnn, kAll } cudnn_fused = CudnnFused::kWhereCudnn;
  // Backward convolution choices per shape (conv_shape_key of the forward problem): the tuner's, else the heuristic.
  std::map<std::string, WgradChoice> wgrad_choice;
  std::map<std::string, DgradChoice> dgrad_choice;
  std::set<Geometry> backward_tuned;
  std::unique_ptr<BackwardConvTuningScratch> tuning_scratch;
  // The backward's launch arguments per geometry and caller's pointers, planned once: a plan costs ~0.2-0.3 ms of
  // host time (H100 machine), paid once per stage by the staged backward, and under DDP the host fell behind.
  std::shared_ptr<BackwardPlanCache> backward_plans;

  // The scratch and job tables replaced by larger ones (EncoderGpu::Impl::retired_memory says why they are kept).
  std::vector<void*> retired_memory;

  ~TrainingState() {
    for (auto& [g, b] : buffers) cudaFree(b.base);
    cudaFree(d_grad_jobs);
    cudaFree(scratch);
    for (void* p : retired_memory) cudaFree(p);
    for (cudaEvent_t e : wgrad_fork) cudaEventDestroy(e);
    if (wgrad_join) cudaEventDestroy(wgrad_join);
  }
};

// Problems of block b whose input is n x h x w (forward conventions of conv_backward.h).
struct BlockProblems {
  Conv2dProblem conv1;      // a -> h2 (k = P)
  Conv2dProblem conv1_cat;  // a -> [conv1 | shortcut] (k = 2P for downsampling blocks, else = conv1)
  Conv2dProblem conv2;      // h2 -> o
  Conv2dProblem conv1_dgrad_fwd;  // identity blocks: dcat (P) -> da (Cin) as a forward conv with flipped filters
};
namespace train_detail {

// The training state of `m`, made on first use (the options' training choices, the parameters' gradient offsets).
TrainingState& training(EncoderGpu::Impl& m);
// Index of a parameter (parameter_specs name) in the gradient layout.
size_t param_index(const TrainingState& t, const std::string& name);
inline size_t align256(size_t b) { return (b + 255) / 256 * 256; }
// The first element of a training graph's key: which launch sequence it is.
enum : int64_t { kForwardTrainGraph = 0, kBackwardGraph = 1 };
// Two halves of `bytes` each (TrainingState::scratch), then `se_bytes` for the squeeze-excite backward's areas.
void ensure_scratch(TrainingState& t, size_t bytes, size_t se_bytes);
void ensure_wgrad_events(TrainingState& t, size_t blocks);
// Every block's problems at geometry g.
std::vector<BlockProblems> geometry_problems(const EncoderGpu::Impl& m, const Geometry& g);
// The backward convolutions' kernels: the tuner's choice for the shape, else the heuristic.
WgradChoice wgrad_for(const EncoderGpu::Impl& m, const TrainingState& t, const Conv2dProblem& p);
DgradChoice dgrad_for(const EncoderGpu::Impl& m, const TrainingState& t, const Conv2dProblem& p);

}  // namespace train_detail
}  // namespace kfuse
