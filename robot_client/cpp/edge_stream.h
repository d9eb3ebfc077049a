// edgerl's Act stream for C++ controllers: the helpers every edgerl C++ client needs (tensors,
// the hello, a step, deadlines) and ControlStream, the stream of a robot behind its watchdog
// (watchdog.h), reconnects and resumes included. Header only; it needs gRPC, protobuf and the
// C++ generated from proto/edgerl/v1/edge.proto (CMakeLists.txt generates it).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "edgerl/v1/edge.grpc.pb.h"
#include "watchdog.h"

namespace edgerl {

// What a stream needs besides the server's address.
struct StreamOptions {
  std::string session = "cpp-client";  // StreamHello.session_id: stable across reconnects
  std::string token;  // a bearer token, if the server asks for one
  double answer_timeout_s = 2.0;  // an answer later than this ends the stream as broken
  double reconnect_s = 10.0;  // how long to keep trying to resume a broken stream; 0: never
};

// A span of the steady clock from seconds.
inline std::chrono::steady_clock::duration Seconds(double s) {
  using std::chrono::duration;
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(duration<double>(s));
}

// Seconds on the steady clock, and back.
inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline std::chrono::steady_clock::time_point At(double seconds) {
  return std::chrono::steady_clock::time_point(Seconds(seconds));
}

// Cancels a call whose answer is overdue: armed when a stream opens (a connection that never
// comes up blocks the opening) and before each step's write and read, disarmed after them.
// (The synchronous API's writes and reads take no deadline of their own.)
class Alarm {
 public:
  Alarm() : thread_([this] { Run(); }) {}
  ~Alarm() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Arm(grpc::ClientContext* ctx, std::chrono::steady_clock::time_point at) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ctx_ = ctx;
      at_ = at;
    }
    cv_.notify_all();
  }
  // Whether the alarm cancelled the call since it was last disarmed.
  bool Disarm() {
    std::lock_guard<std::mutex> lock(mu_);
    ctx_ = nullptr;
    const bool fired = fired_;
    fired_ = false;
    return fired;
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (ctx_ == nullptr) {
        cv_.wait(lock);
      } else if (std::chrono::steady_clock::now() >= at_) {
        ctx_->TryCancel();
        ctx_ = nullptr;
        fired_ = true;
      } else {
        cv_.wait_until(lock, at_);
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  grpc::ClientContext* ctx_ = nullptr;
  std::chrono::steady_clock::time_point at_;
  bool fired_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: it starts once the members above are set
};

// FLOAT32 tensor, little-endian raw bytes (x86 and ARM hosts are little-endian).
inline v1::Tensor Float32(const std::vector<float>& values, const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT32);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(values.data(), values.size() * sizeof(float));
  return t;
}

inline std::vector<float> Floats(const v1::Tensor& t) {
  if (t.dtype() != v1::FLOAT32) throw std::runtime_error("actions: expected FLOAT32");
  std::vector<float> out(t.data().size() / sizeof(float));
  std::memcpy(out.data(), t.data().data(), out.size() * sizeof(float));
  return out;
}

inline void AddAuth(grpc::ClientContext* ctx, const StreamOptions& o, double deadline_s) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000)));
  if (!o.token.empty()) ctx->AddMetadata("authorization", "Bearer " + o.token);
}

// The first message of a stream of env 0 (one robot, one env). `mid_episode`: a stream after
// the first, or one that opens after the robot stepped. Every stream resumes the session
// (StreamHello.resumes): each request carries its number (StepObservation.obs_index).
inline v1::ActRequest Hello(const StreamOptions& o, const v1::DescribeResponse& info, bool mid_episode) {
  v1::ActRequest hello;
  auto* h = hello.mutable_hello();
  h->set_session_id(o.session);
  h->set_env_name(info.env_name());
  h->set_num_envs(1);
  for (int64_t d : info.observation_space().shape()) h->add_obs_shape(d);
  h->set_max_inflight(1);
  h->set_mid_episode(mid_episode);
  h->set_resumes(true);
  return hello;
}

// A step of env 0: its observation, what the actions since its last request earned (reward,
// and whether any of them was a fallback), and its number among the env's requests.
inline v1::ActRequest StepRequest(const std::vector<float>& obs, float reward, bool fallback,
                                  uint64_t index) {
  v1::ActRequest req;
  auto* st = req.mutable_step();
  st->add_env_ids(0);
  *st->mutable_obs() = Float32(obs, {1, static_cast<int64_t>(obs.size())});
  st->add_rewards(reward);
  st->add_terminated(false);
  st->add_truncated(false);
  st->add_fallback(fallback);
  st->add_obs_index(index);
  return req;
}

// The status of a stream whose answer the alarm found overdue.
inline grpc::Status Overdue(double answer_timeout_s) {
  std::ostringstream why;
  why << "no answer within " << answer_timeout_s << " s";
  return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, why.str());
}

// Whether a stream that ended with `s` is worth a new one: UNAVAILABLE (the server restarted,
// the network dropped the connection) or DEADLINE_EXCEEDED (an answer overdue here, or a hello
// the server did not get in time: a link that went silent). Python's clients retry the same
// two (robot_client.errors.BROKEN_STREAM); any other status is the server's answer for good.
inline bool Transient(const grpc::Status& s) {
  return s.error_code() == grpc::StatusCode::UNAVAILABLE ||
         s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
}

// The wait before a new stream: 50 ms doubling to 1 s over the attempts since the last answer,
// times a jitter in [0.5, 1), so that a fleet that lost its server together does not come back
// in lockstep.
class Backoff {
 public:
  std::chrono::duration<double, std::milli> Delay(int attempt) {
    return std::chrono::duration<double, std::milli>(std::min(50 << std::min(attempt, 5), 1000) *
                                                     jitter_(rng_));
  }

 private:
  std::mt19937 rng_{std::random_device{}()};
  std::uniform_real_distribution<double> jitter_{0.5, 1.0};
};

// The line that tells of reconnect `n`, after the stream broke with `s`.
inline std::string ReconnectLine(int n, const grpc::Status& s) {
  std::ostringstream line;
  line << "reconnect " << n << " after " << s.error_code() << ' ' << s.error_message();
  return line.str();
}

// Makes a stub on a channel of its own (one per stream).
using StubFactory = std::function<std::unique_ptr<v1::EdgePolicy::Stub>()>;

// An Act call: the stub of its channel, its context and its stream, which go in the order gRPC
// needs (the finished call before its context, both before their channel). Declare the Alarm
// that watches it after it, so that the alarm stops first.
struct ActCall {
  std::unique_ptr<v1::EdgePolicy::Stub> stub;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ActRequest, v1::ActResponse>> stream;

  // Drops the call before (if any) and opens a new one, on a new channel from `stubs` where
  // `new_channel` or there is no stub yet, and writes `hello`. `alarm` is armed answer_timeout_s
  // ahead first (a connection that never comes up blocks the opening) and left armed. Whether
  // the hello was written; a failure also shows at the first step's write or read.
  bool Open(const StubFactory& stubs, bool new_channel, const StreamOptions& o, Alarm* alarm,
            const v1::ActRequest& hello) {
    stream.reset();
    ctx.reset();
    if (new_channel || !stub) stub = stubs();
    ctx = std::make_unique<grpc::ClientContext>();
    AddAuth(ctx.get(), o, 3600.0);
    alarm->Arm(ctx.get(), std::chrono::steady_clock::now() + Seconds(o.answer_timeout_s));
    stream = stub->Act(ctx.get());  // waits for the connection
    return stream->Write(hello);
  }
};

// A robot's Act stream behind its watchdog, on a thread of its own. It keeps the stream open,
// reconnecting with backoff and jitter (50 ms to 1 s) where it ends with a Transient() status,
// on a new connection, and resuming the session (StreamHello.mid_episode and resumes). It sends
// the observations the control loop hands it with Step(), one request in flight at a time,
// and hands each answer to the watchdog (Watchdog::Submit), which decides whether it is in
// time. The loop never waits on it: Step() takes a lock, no more.
//
// What the robot earns is carried as the wire contract asks: each request carries the reward
// of every tick since the robot's previous request, with fallback set if one of those ticks
// applied a fallback, and its number among the robot's requests (StepObservation.obs_index).
// The request lost with a broken stream goes into the next one, under its number, so that the
// server completes the step it answered last with it, or answers it in the lost one's place.
class ControlStream {
 public:
  // `stubs` makes a stub on a new channel for each stream (a local subchannel pool, so that the
  // new stream does not share a dead connection); `info` is the server's Describe answer; `say`
  // (if set) gets a line for each reconnect.
  ControlStream(const StreamOptions& o, const v1::DescribeResponse& info, StubFactory stubs,
                Watchdog* watchdog, std::function<void(const std::string&)> say = nullptr)
      : o_(o), info_(info), stubs_(std::move(stubs)), watchdog_(watchdog), say_(std::move(say)),
        thread_([this] { Run(); }) {}
  ~ControlStream() { Stop(); }

  // The control loop, after tick `tick` applied its action (a fallback or not) and read the
  // robot at `time` (Now()): the observation, and the reward the tick's action earned. Where
  // `ask` (the robot wants its next answer: the one held runs low), the observation is sent at
  // once if the stream is open and has no request in flight. What the robot earned is kept
  // for its next request in any case.
  void Step(int64_t tick, double time, std::vector<float> obs, float reward, bool fallback,
            bool ask = true) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stepped_ = true;
      if (lost_) {  // earned before what the robot earned since
        earned_ += lost_->reward;
        fell_back_ = fell_back_ || lost_->fallback;
        requests_ = lost_->index;
        lost_.reset();
      }
      earned_ += reward;
      fell_back_ = fell_back_ || fallback;
      if (!ask || !open_ || inflight_ || stop_) return;
      inflight_ = Request{tick, time, std::move(obs), earned_, fell_back_, requests_++};
      ++sent_;
      earned_ = 0.0f;
      fell_back_ = false;
    }
    cv_.notify_all();
  }

  // The stream ended for good (a status not worth retrying, or no stream within reconnect_s).
  bool Failed(grpc::Status* why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) *why = status_;
    return failed_;
  }

  // The policy version of the last answer.
  uint64_t version() {
    std::lock_guard<std::mutex> lock(mu_);
    return version_;
  }

  // What /metrics tells of the stream (metrics.h).
  struct Figures {
    bool up = false;  // a stream is open, and the stream has not ended for good
    int64_t reconnects = 0;  // streams that failed or could not open, and were opened again
    int64_t requests = 0;  // observations handed to a stream (one lost with a stream: again)
    int64_t answers = 0;  // answers handed to the watchdog
    bool answered = false;  // an answer came: version() is the policy's
  };
  Figures figures() {
    std::lock_guard<std::mutex> lock(mu_);
    return {open_ && !failed_, reconnects_, sent_, answers_, answers_ > 0};
  }

  // The q-quantile of the time from an observation to its answer, over the last 8,192 answers
  // (seconds; NaN before the first).
  double LatencyQuantile(double q) const { return latency_.Quantile(q); }

  // End the stream (after the answer in flight, at most answer_timeout_s) and the thread.
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Run() {
    Backoff backoff;
    int reconnects = 0;
    int attempt = 0;  // since the last answer
    double outage_since = Now();
    for (;;) {
      bool answered = false;
      grpc::Status s = Serve(&answered);
      std::unique_lock<std::mutex> lock(mu_);
      if (stop_ && s.ok()) return;
      if (answered) {
        attempt = 0;
        outage_since = Now();
      }
      if (stop_ || !Transient(s) || Now() - outage_since >= o_.reconnect_s) {
        if (!stop_) {
          failed_ = true;
          status_ = s;
        }
        return;
      }
      ++reconnects;
      reconnects_ = reconnects;
      if (say_) {
        lock.unlock();
        say_(ReconnectLine(reconnects, s));
        lock.lock();
      }
      if (cv_.wait_for(lock, backoff.Delay(attempt++), [this] { return stop_; })) return;
    }
  }

  // One stream: open it, send each request the loop hands it and hand each answer to the
  // watchdog, until the stream breaks (its status) or Stop() (OK). `answered`: an answer came.
  grpc::Status Serve(bool* answered) {
    bool mid_episode = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Under the lock that Step() takes: a tick either comes before (the stream starts
      // mid-episode) or finds the stream open and hands its request to it.
      mid_episode = streams_ > 0 || stepped_;
      open_ = true;
    }
    ++streams_;
    const auto answer_timeout = Seconds(o_.answer_timeout_s);
    bool up = call_.Open(stubs_, true, o_, &alarm_, Hello(o_, info_, mid_episode));
    bool overdue = alarm_.Disarm();
    up = up && !overdue;
    uint64_t seq = 0;
    while (up) {
      Request r;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || inflight_; });
        if (stop_) break;
        r = *inflight_;
      }
      v1::ActRequest req = StepRequest(r.obs, r.reward, r.fallback, r.index);
      req.mutable_step()->set_seq(seq);
      v1::ActResponse resp;
      alarm_.Arm(call_.ctx.get(), std::chrono::steady_clock::now() + answer_timeout);
      const bool ok = call_.stream->Write(req) && call_.stream->Read(&resp);
      overdue = alarm_.Disarm();
      if (overdue || !ok) {
        up = false;
        break;
      }
      if (resp.seq() != seq || resp.actions().dtype() != v1::FLOAT32) {
        std::ostringstream why;
        why << "protocol: answer for seq " << resp.seq() << " (expected " << seq
            << ") with actions of dtype " << resp.actions().dtype() << " (expected FLOAT32)";
        call_.ctx->TryCancel();
        call_.stream->Finish();
        return Close(grpc::Status(grpc::StatusCode::INTERNAL, why.str()));
      }
      ++seq;
      *answered = true;
      const double now = Now();
      watchdog_->Submit(Floats(resp.actions()), r.tick, r.time, resp.policy_version(), now);
      latency_.Add(now - r.time);
      std::lock_guard<std::mutex> lock(mu_);
      inflight_.reset();
      version_ = resp.policy_version();
      ++answers_;
    }
    if (up) {  // Stop(): nothing is in flight on the wire
      call_.stream->WritesDone();
      alarm_.Arm(call_.ctx.get(), std::chrono::steady_clock::now() + answer_timeout);
      grpc::Status s = call_.stream->Finish();
      alarm_.Disarm();
      {
        std::lock_guard<std::mutex> lock(mu_);
        open_ = false;
      }
      return s.ok() || s.error_code() == grpc::StatusCode::CANCELLED ? grpc::Status::OK : s;
    }
    grpc::Status s = call_.stream->Finish();
    if (overdue) {
      s = Overdue(o_.answer_timeout_s);
    } else if (s.ok()) {  // the server ended the stream with a request unanswered: a new one
      s = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the server ended the stream without an answer");
    }
    return Close(s);
  }

  // The stream broke with `s`: the request in flight is lost, for the loop to take back.
  grpc::Status Close(grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = false;
    lost_ = std::move(inflight_);
    inflight_.reset();
    return s;
  }

  // A request: the observation read at a tick, and what the robot earned since its last one.
  struct Request {
    int64_t tick = 0;
    double time = 0.0;  // when the observation was read (Now())
    std::vector<float> obs;
    float reward = 0.0f;
    bool fallback = false;
    uint64_t index = 0;  // StepObservation.obs_index
  };

  const StreamOptions o_;
  const v1::DescribeResponse info_;
  const StubFactory stubs_;
  Watchdog* const watchdog_;
  const std::function<void(const std::string&)> say_;
  // The network thread's own.
  ActCall call_;
  int streams_ = 0;
  RecentWindow latency_;  // read by figures' readers too: a lock of its own
  Alarm alarm_;  // after call_: it stops before the call goes
  // Shared with the loop, under mu_.
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;  // a stream takes requests
  bool stepped_ = false;  // the loop has ticked
  bool stop_ = false;
  bool failed_ = false;
  grpc::Status status_;
  std::optional<Request> inflight_, lost_;
  float earned_ = 0.0f;  // the reward since the robot's last request
  bool fell_back_ = false;  // a fallback since the robot's last request
  uint64_t requests_ = 0;  // the robot's requests made
  uint64_t version_ = 0;
  int64_t sent_ = 0, answers_ = 0, reconnects_ = 0;  // for figures()
  std::thread thread_;  // last: it starts once the members above are set
};

}  // namespace edgerl
