// Checks of watchdog.h on a clock the test sets: prints each failed check and exits 1, or
// prints "OK <n> checks" and exits 0. Built beside the client (edgerl_watchdog_test).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <stdexcept>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "watchdog.h"

namespace {

int checks = 0;
int failures = 0;

void Check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::cout << "FAILED " << what << std::endl;
  }
}

std::string Str(const std::vector<float>& v) {
  std::ostringstream s;
  for (float x : v) s << x << ' ';
  return s.str();
}

// Equal to float rounding (an action moves by sums of float steps).
void Same(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  bool same = got.size() == want.size();
  for (std::size_t i = 0; same && i < got.size(); ++i) same = std::fabs(got[i] - want[i]) <= 1e-6f;
  Check(same, what + ": got " + Str(got) + "want " + Str(want));
}

using edgerl::Fallback;
using edgerl::Tick;
using edgerl::TickKind;
using edgerl::Watchdog;
using edgerl::WatchdogConfig;

WatchdogConfig Config(double deadline_s = 0.02, Fallback fallback = Fallback::kHold, int estop_after = 0,
                      double max_delta = 0.0) {
  WatchdogConfig c;
  c.deadline_s = deadline_s;
  c.fallback = fallback;
  c.estop_after = estop_after;
  c.max_delta = max_delta;
  return c;
}

// Tick i of a 50 Hz loop.
double T(int64_t i) { return i * 0.02; }

void AnAnswerIsAppliedAtTheTickAfterItsObservation() {
  Watchdog w({-1, -1}, {1, 1}, Config());
  Tick t0 = w.Step(0, T(0));
  Check(t0.kind == TickKind::kFallback, "tick 0 has no answer: a fallback");
  Same(t0.action, {0, 0}, "tick 0 starts at zero");
  Check(w.Submit({0.25f, -0.25f}, 0, T(0), 7, T(0) + 0.005), "an answer 5 ms after its observation is taken");
  Tick t1 = w.Step(1, T(1));
  Check(t1.kind == TickKind::kPolicy && t1.version == 7, "tick 1 applies it, with its version");
  Same(t1.action, {0.25f, -0.25f}, "tick 1's action");
  Check(std::fabs(t1.age_s - 0.02) < 1e-9, "its age is the time since its observation");
  Tick t2 = w.Step(2, T(2));
  Check(t2.kind == TickKind::kFallback && std::isnan(t2.age_s),
        "one action serves one tick: tick 2 falls back");
  Same(t2.action, {0.25f, -0.25f}, "the hold fallback repeats the last action");
}

void AChunkServesTheTicksAfterItsObservation() {
  Watchdog w({-1}, {1}, Config());
  w.Step(0, T(0));
  Check(w.Submit({0.1f, 0.2f, 0.3f}, 0, T(0), 1, T(0) + 0.001), "a chunk of three is taken");
  Same(w.Step(1, T(1)).action, {0.1f}, "chunk action 0 at tick 1");
  Same(w.Step(2, T(2)).action, {0.2f}, "chunk action 1 at tick 2");
  Check(w.Remaining() == 1, "one action of the chunk left after tick 2");
  Same(w.Step(3, T(3)).action, {0.3f}, "chunk action 2 at tick 3");
  Check(w.Remaining() == 0, "none left after tick 3");
  Check(w.Step(4, T(4)).kind == TickKind::kFallback, "tick 4: the chunk is spent");
  Watchdog fresh({-1}, {1}, Config());
  Check(fresh.Remaining() == 0, "none held: none left");
  fresh.Step(0, T(0));
  fresh.Submit({0.1f, 0.2f}, 0, T(0), 1, T(0));
  Check(fresh.Remaining() == 2, "a chunk of two for the ticks after tick 0: two left");
}

void ALateOrOlderAnswerIsDropped() {
  Watchdog w({-1}, {1}, Config(0.02));
  Check(!w.Submit({0.5f}, 3, T(3), 1, T(3) + 0.021), "an answer 21 ms after its observation is late");
  Check(w.stats().late_actions == 1, "and counted late");
  Check(w.Submit({0.5f}, 3, T(3), 1, T(3) + 0.019), "19 ms is in time");
  Check(!w.Submit({0.4f}, 2, T(2), 1, T(3) + 0.019), "an answer to an older observation than the one held");
  Check(!w.Submit({0.4f}, 3, T(3), 1, T(3) + 0.019), "or the same one is dropped");
  Same(w.Step(4, T(4)).action, {0.5f}, "the answer held is applied");
  Check(!w.Submit({}, 4, T(4), 1, T(4)), "no values are refused");
  Watchdog two({-1, -1}, {1, 1}, Config());
  Check(!two.Submit({0.1f, 0.2f, 0.3f}, 4, T(4), 1, T(4)), "3 values for 2 dimensions are refused");
  Check(two.stats().wrong_shape == 1, "and counted");
}

void ANonFiniteActionIsNeverApplied() {
  Watchdog w({-1, -1}, {1, 1}, Config());
  w.Submit({0.1f, 0.1f, std::numeric_limits<float>::quiet_NaN(), 0.2f, 0.3f, 0.3f}, 0, T(0), 1, T(0));
  Check(w.Step(1, T(1)).kind == TickKind::kPolicy, "chunk action 0 is finite: applied");
  Tick t = w.Step(2, T(2));
  Check(t.kind == TickKind::kFallback, "chunk action 1 holds a NaN: a fallback");
  Same(t.action, {0.1f, 0.1f}, "which holds the last action");
  Check(w.stats().nonfinite_actions == 1, "counted as non-finite");
  Same(w.Step(3, T(3)).action, {0.3f, 0.3f}, "chunk action 2 is applied");
  Watchdog inf({-1}, {1}, Config());
  inf.Submit({std::numeric_limits<float>::infinity()}, 0, T(0), 1, T(0));
  Check(inf.Step(1, T(1)).kind == TickKind::kFallback, "an infinite action is not applied either");
}

void EveryActionIsClampedAndRateLimited() {
  Watchdog w({-1, 0}, {1, 2}, Config(0.02, Fallback::kHold, 0, 0.3));
  Same(w.Step(0, T(0)).action, {0, 0}, "zero clamped into the limits");
  w.Submit({5.0f, -5.0f}, 0, T(0), 1, T(0));
  Same(w.Step(1, T(1)).action, {0.3f, 0.0f}, "at most max_delta per tick, within the limits");
  w.Submit({5.0f, 1.0f}, 1, T(1), 1, T(1));
  Same(w.Step(2, T(2)).action, {0.6f, 0.3f}, "the next tick moves on by max_delta");
  Watchdog lim({2, 2}, {3, 3}, Config());  // zero is outside: the start is the lower limit
  Same(lim.Step(0, T(0)).action, {2, 2}, "zero clamped into [2, 3]");
  const float inf = std::numeric_limits<float>::infinity();
  Watchdog open({-inf}, {inf}, Config());
  open.Submit({10.0f}, 0, T(0), 1, T(0));
  Same(open.Step(1, T(1)).action, {1.0f}, "an unbounded dimension moves at most 1 per tick by default");
}

void TheZeroFallbackRampsToZero() {
  Watchdog w({-1}, {1}, Config(0.02, Fallback::kZero, 0, 0.4));
  w.Submit({1.0f}, 0, T(0), 1, T(0));
  w.Step(1, T(1));
  w.Submit({1.0f}, 1, T(1), 1, T(1));
  w.Step(2, T(2));
  w.Submit({1.0f}, 2, T(2), 1, T(2));
  Same(w.Step(3, T(3)).action, {1.0f}, "at 1 after three answers");
  Same(w.Step(4, T(4)).action, {0.6f}, "no answer: toward zero by max_delta");
  Same(w.Step(5, T(5)).action, {0.2f}, "and on");
  Same(w.Step(6, T(6)).action, {0.0f}, "to zero, not past it");
}

void ConsecutiveFallbacksLatchAnEstopUntilReset() {
  Watchdog w({-1}, {1}, Config(0.02, Fallback::kHold, 3, 0.5), {-1.0f});
  w.Submit({1.0f}, 0, T(0), 1, T(0));
  w.Step(1, T(1));
  w.Submit({1.0f}, 1, T(1), 1, T(1));
  Same(w.Step(2, T(2)).action, {1.0f}, "at 1");
  Check(w.Step(3, T(3)).kind == TickKind::kFallback, "fallback 1");
  Check(w.Step(4, T(4)).kind == TickKind::kFallback, "fallback 2");
  Tick t5 = w.Step(5, T(5));
  Check(t5.kind == TickKind::kEstop && w.estopped(), "the third fallback latches the e-stop");
  Same(t5.action, {0.5f}, "which ramps to the stop action at max_delta");
  w.Submit({1.0f}, 5, T(5), 1, T(5));
  Tick t6 = w.Step(6, T(6));
  Check(t6.kind == TickKind::kEstop, "a fresh answer does not end the e-stop");
  Same(t6.action, {0.0f}, "the ramp goes on");
  Check(!w.at_stop_action(), "not at the stop action yet");
  w.Step(7, T(7));
  w.Step(8, T(8));
  Check(w.at_stop_action(), "at the stop action after the ramp");
  Check(w.stats().estops == 1 && w.stats().max_consecutive_fallbacks == 6, "one e-stop, a streak of 6");
  w.Reset();
  Check(!w.estopped(), "Reset() clears it");
  w.Submit({-0.5f}, 8, T(8), 1, T(8));
  Tick t9 = w.Step(9, T(9));
  Check(t9.kind == TickKind::kPolicy, "policy actions apply again");
  Same(t9.action, {-0.5f}, "the answer after the reset");
  Watchdog outside({-1}, {1}, Config(0.02, Fallback::kHold, 0));
  outside.Estop();
  Check(outside.Step(0, T(0)).kind == TickKind::kEstop, "Estop() latches from outside");
  Check(outside.at_stop_action(), "zero is the default stop action");
}

void BadSettingsAreRefusedNamingThem() {
  auto refused = [](const std::string& name, auto make) {
    try {
      make();
    } catch (const std::invalid_argument& e) {
      Check(std::string(e.what()).find(name) != std::string::npos, name + ": " + e.what());
      return;
    }
    Check(false, name + " was not refused");
  };
  refused("deadline_s", [] { Watchdog({-1}, {1}, Config(0)); });
  refused("deadline_s", [] { Watchdog({-1}, {1}, Config(std::numeric_limits<double>::infinity())); });
  refused("estop_after", [] { Watchdog({-1}, {1}, Config(0.02, Fallback::kHold, -1)); });
  refused("max_delta", [] { Watchdog({-1}, {1}, Config(0.02, Fallback::kHold, 0, -0.1)); });
  refused("action limits", [] { Watchdog({1}, {-1}, Config()); });
  refused("action limits", [] { Watchdog({-1, -1}, {1}, Config()); });
  refused("action limits", [] { Watchdog({std::numeric_limits<float>::quiet_NaN()}, {1}, Config()); });
  refused("stop_action", [] { Watchdog({-1}, {1}, Config(), {0, 0}); });
  refused("stop_action", [] { Watchdog({-1}, {1}, Config(), {std::numeric_limits<float>::infinity()}); });
}

// RecentWindow's quantiles are numpy's (linear interpolation), over the last `capacity` values.
void AWindowsQuantilesAreNumpysOverItsLastValues() {
  edgerl::RecentWindow window(10);
  Check(std::isnan(window.Quantile(0.5)), "an empty window's quantile is NaN");
  window.Add(3.0);
  Check(window.Quantile(0.5) == 3.0 && window.Quantile(0.99) == 3.0, "one value is every quantile");
  for (int v = 1; v <= 12; ++v) window.Add(v);  // holds 3..12: the first three are overwritten
  // numpy.percentile(range(3, 13), [50, 99]) = [7.5, 11.91]
  Check(window.Quantile(0.5) == 7.5, "p50 of 3..12");
  Check(std::fabs(window.Quantile(0.99) - 11.91) < 1e-12, "p99 of 3..12");
  Check(window.Quantile(0.0) == 3.0 && window.Quantile(1.0) == 12.0, "p0 and p100 of 3..12");
  bool refused = false;
  try {
    edgerl::RecentWindow none(0);
  } catch (const std::invalid_argument&) {
    refused = true;
  }
  Check(refused, "a window of no value is refused");
}

}  // namespace

int main() {
  AnAnswerIsAppliedAtTheTickAfterItsObservation();
  AChunkServesTheTicksAfterItsObservation();
  ALateOrOlderAnswerIsDropped();
  ANonFiniteActionIsNeverApplied();
  EveryActionIsClampedAndRateLimited();
  TheZeroFallbackRampsToZero();
  ConsecutiveFallbacksLatchAnEstopUntilReset();
  BadSettingsAreRefusedNamingThem();
  AWindowsQuantilesAreNumpysOverItsLastValues();
  if (failures) {
    std::cout << failures << " of " << checks << " checks failed" << std::endl;
    return 1;
  }
  std::cout << "OK " << checks << " checks" << std::endl;
  return 0;
}
