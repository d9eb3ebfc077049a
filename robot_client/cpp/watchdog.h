// edgerl::Watchdog: the safety watchdog of edgerl (watchdog/watchdog.py) for C++ controllers.
// Header only; needs nothing but the standard library, so a controller includes it as it is.
//
// A fixed-rate control loop calls Step() at each tick and applies the action it returns; the
// thread that talks to the policy server calls Submit() with each answer. Nothing in Step()
// waits on the network: the two share a lock held for a few microseconds.
//
// Timing of policy actions, as in Python. The observation read at tick n is answered by one
// action or a chunk of K actions: action k is meant for tick n + 1 + k. An answer is accepted
// only if it arrives within deadline_s of its observation; a later one is dropped as late. At
// tick j the watchdog applies action j - n - 1 of the newest accepted answer if it holds one,
// and a fallback otherwise: hold (repeat the last action applied) or zero (go to zero, clamped
// into the limits). Every action leaving it, fallbacks included, is clamped to the action
// limits and rate-limited to max_delta per tick, so nothing jumps; a NaN or infinite policy
// action is never applied (the tick falls back). After estop_after consecutive fallbacks it
// latches an e-stop: it ramps to the stop action and stays there until Reset().
//
// Times are seconds on one monotonic clock of the caller's choice (the loop's steady clock;
// a test's own counter).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace edgerl {

enum class Fallback { kHold, kZero };

enum class TickKind { kPolicy, kFallback, kEstop };

inline const char* TickKindName(TickKind kind) {
  switch (kind) {
    case TickKind::kPolicy: return "policy";
    case TickKind::kFallback: return "fallback";
    case TickKind::kEstop: return "estop";
  }
  return "?";
}

struct WatchdogConfig {
  double deadline_s = 0.02;  // latency budget: an answer within this long of its observation
  Fallback fallback = Fallback::kHold;
  int estop_after = 50;  // consecutive fallbacks that latch an e-stop; 0: never
  double max_delta = 0.0;  // largest change per tick, every dimension; 0: 25 % of its range
                           // (1 where the range is unbounded)
};

// What the watchdog decided at one tick.
struct Tick {
  int64_t index = 0;
  TickKind kind = TickKind::kFallback;
  std::vector<float> action;  // clamped and rate-limited: apply this
  double age_s = std::numeric_limits<double>::quiet_NaN();  // since its observation; NaN: fallback
  uint64_t version = 0;  // of the policy action (its Submit's); 0 for fallbacks
  bool fallback() const { return kind != TickKind::kPolicy; }
};

struct WatchdogStats {
  int64_t ticks = 0;
  int64_t policy_ticks = 0;
  int64_t fallbacks = 0;
  int64_t consecutive_fallbacks = 0;
  int64_t max_consecutive_fallbacks = 0;
  int64_t loop_deadline_misses = 0;  // ticks the loop skipped because it ran a period late
  int64_t estops = 0;
  int64_t late_actions = 0;  // answers dropped because they came after the deadline
  int64_t nonfinite_actions = 0;  // policy actions not applied because of a NaN or infinity
  int64_t wrong_shape = 0;  // answers dropped because their size is no whole number of actions
};

class Watchdog {
 public:
  // low, high: the action limits, one per dimension (either may be infinite). stop_action:
  // what an e-stop ramps to; empty: zero clamped into the limits. Throws std::invalid_argument
  // naming the setting that is out of range.
  Watchdog(std::vector<float> low, std::vector<float> high, WatchdogConfig config,
           std::vector<float> stop_action = {})
      : config_(config), low_(std::move(low)), high_(std::move(high)) {
    if (low_.empty() || low_.size() != high_.size()) {
      throw std::invalid_argument("action limits: need one low and one high per dimension");
    }
    for (std::size_t d = 0; d < low_.size(); ++d) {
      if (!(low_[d] <= high_[d])) throw std::invalid_argument("action limits: need low <= high");
    }
    if (!(config_.deadline_s > 0 && std::isfinite(config_.deadline_s))) {
      throw std::invalid_argument("deadline_s must be a finite number > 0");
    }
    if (config_.estop_after < 0) throw std::invalid_argument("estop_after must be >= 0");
    if (!(config_.max_delta >= 0 && std::isfinite(config_.max_delta))) {
      throw std::invalid_argument("max_delta must be a finite number >= 0");
    }
    for (std::size_t d = 0; d < low_.size(); ++d) {
      const float span = high_[d] - low_[d];
      delta_.push_back(config_.max_delta > 0   ? static_cast<float>(config_.max_delta)
                       : std::isfinite(span) ? 0.25f * span
                                             : 1.0f);
    }
    zero_ = Clamp(std::vector<float>(low_.size(), 0.0f));
    if (stop_action.empty()) {
      stop_ = zero_;
    } else {
      if (stop_action.size() != low_.size()) {
        throw std::invalid_argument("stop_action: need one value per action dimension");
      }
      for (float v : stop_action) {
        if (!std::isfinite(v)) throw std::invalid_argument("stop_action must be finite");
      }
      stop_ = Clamp(stop_action);
    }
    last_ = zero_;
  }

  std::size_t act_dim() const { return low_.size(); }

  // The answer to the observation read at tick obs_tick (at time obs_time), arrived at now:
  // one action or a chunk (its size a multiple of act_dim()). Any thread. False where it was
  // dropped: late, answering an observation older than the one held, or of the wrong size.
  bool Submit(const std::vector<float>& actions, int64_t obs_tick, double obs_time, uint64_t version,
              double now) {
    const std::size_t dim = act_dim();
    std::lock_guard<std::mutex> lock(mu_);
    if (actions.empty() || actions.size() % dim != 0) {
      ++stats_.wrong_shape;
      return false;
    }
    if (now - obs_time > config_.deadline_s) {
      ++stats_.late_actions;
      return false;
    }
    if (held_ && obs_tick <= chunk_.obs_tick) return false;
    chunk_.actions = actions;
    chunk_.obs_tick = obs_tick;
    chunk_.obs_time = obs_time;
    chunk_.version = version;
    held_ = true;
    return true;
  }

  // Run tick `index` at time `now` (the loop's thread): the action to apply, and why.
  Tick Step(int64_t index, double now) {
    Tick t;
    t.index = index;
    std::vector<float> target;
    std::lock_guard<std::mutex> lock(mu_);
    tick_index_ = index;
    ++stats_.ticks;
    if (!estopped_ && PolicyAction(index, now, &target, &t)) {
      t.kind = TickKind::kPolicy;
      stats_.consecutive_fallbacks = 0;
      ++stats_.policy_ticks;
    } else {
      ++stats_.fallbacks;
      const int64_t streak = ++stats_.consecutive_fallbacks;
      stats_.max_consecutive_fallbacks = std::max(stats_.max_consecutive_fallbacks, streak);
      if (config_.estop_after > 0 && streak >= config_.estop_after) Latch();
      t.kind = estopped_ ? TickKind::kEstop : TickKind::kFallback;
      target = estopped_ ? stop_ : config_.fallback == Fallback::kHold ? last_ : zero_;
    }
    // Clamp and rate-limit in one: last_ is within the limits, so the two ranges overlap.
    for (std::size_t d = 0; d < target.size(); ++d) {
      const float lo = std::max(last_[d] - delta_[d], low_[d]);
      const float hi = std::min(last_[d] + delta_[d], high_[d]);
      last_[d] = std::min(std::max(target[d], lo), hi);
    }
    t.action = last_;
    return t;
  }

  // Policy actions left in the held answer for the ticks after the last one run (a robot asks
  // for the next answer when this is low: its refill level).
  int64_t Remaining() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!held_) return 0;
    const auto k = static_cast<int64_t>(chunk_.actions.size() / act_dim());
    return std::max<int64_t>(0, k - (tick_index_ - chunk_.obs_tick));
  }

  // The loop skipped `ticks` ticks because it ran late: counted, not applied.
  void Missed(int64_t ticks) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.loop_deadline_misses += ticks;
  }

  // Latch an e-stop from outside (e.g. the policy server is gone for good).
  void Estop() {
    std::lock_guard<std::mutex> lock(mu_);
    Latch();
  }

  // Clear a latched e-stop and the fallback streak; policy actions apply again.
  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    estopped_ = false;
    stats_.consecutive_fallbacks = 0;
    held_ = false;
  }

  bool estopped() const {
    std::lock_guard<std::mutex> lock(mu_);
    return estopped_;
  }

  // E-stopped, and the last action applied was the stop action (the ramp is over).
  bool at_stop_action() const {
    std::lock_guard<std::mutex> lock(mu_);
    return estopped_ && last_ == stop_;
  }

  WatchdogStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  struct Chunk {
    std::vector<float> actions;  // K * act_dim
    int64_t obs_tick = 0;
    double obs_time = 0.0;
    uint64_t version = 0;
  };

  std::vector<float> Clamp(std::vector<float> v) const {
    for (std::size_t d = 0; d < v.size(); ++d) v[d] = std::min(std::max(v[d], low_[d]), high_[d]);
    return v;
  }

  // The held answer's action for tick `index`, if it has one and it is finite (mu_ held).
  bool PolicyAction(int64_t index, double now, std::vector<float>* out, Tick* t) {
    if (!held_) return false;
    const std::size_t dim = act_dim();
    const int64_t k = index - chunk_.obs_tick - 1;
    if (k < 0 || k >= static_cast<int64_t>(chunk_.actions.size() / dim)) return false;
    const auto first = chunk_.actions.begin() + static_cast<std::ptrdiff_t>(k * dim);
    out->assign(first, first + static_cast<std::ptrdiff_t>(dim));
    for (float v : *out) {
      if (!std::isfinite(v)) {
        ++stats_.nonfinite_actions;
        return false;
      }
    }
    t->age_s = now - chunk_.obs_time;
    t->version = chunk_.version;
    return true;
  }

  void Latch() {
    if (!estopped_) {
      estopped_ = true;
      ++stats_.estops;
    }
  }

  const WatchdogConfig config_;
  const std::vector<float> low_, high_;
  std::vector<float> delta_, zero_, stop_;
  mutable std::mutex mu_;
  std::vector<float> last_;
  Chunk chunk_;
  bool held_ = false;
  int64_t tick_index_ = -1;  // the last tick run
  bool estopped_ = false;
  WatchdogStats stats_;
};

// The last `capacity` values of a figure (as `edgerl robot` keeps 8,192 of each), for its
// quantiles. Thread-safe: one thread adds (a control loop, a stream), another reads (metrics.h).
class RecentWindow {
 public:
  // Throws std::invalid_argument where capacity is 0.
  explicit RecentWindow(std::size_t capacity = 8192) : values_(capacity) {
    if (capacity == 0) throw std::invalid_argument("RecentWindow: capacity must be > 0");
  }

  void Add(double v) {
    std::lock_guard<std::mutex> lock(mu_);
    values_[next_] = v;
    next_ = (next_ + 1) % values_.size();
    count_ = std::min(count_ + 1, values_.size());
  }

  // The q-quantile (q in [0, 1]) of the values held, interpolated linearly between the two
  // nearest (numpy's default, as `edgerl robot` reports); NaN where none is held.
  double Quantile(double q) const {
    std::vector<double> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      held.assign(values_.begin(), values_.begin() + static_cast<std::ptrdiff_t>(count_));
    }
    if (held.empty()) return std::numeric_limits<double>::quiet_NaN();
    std::sort(held.begin(), held.end());
    const double at = q * static_cast<double>(held.size() - 1);
    const auto below = static_cast<std::size_t>(std::floor(at));
    const std::size_t above = std::min(below + 1, held.size() - 1);
    return held[below] + (held[above] - held[below]) * (at - static_cast<double>(below));
  }

 private:
  mutable std::mutex mu_;
  std::vector<double> values_;
  std::size_t next_ = 0;
  std::size_t count_ = 0;
};

}  // namespace edgerl
