// edgerl_cpp_client: stream observations to an edgerl edge server from a fixed-rate loop
// and print the actions that come back. It shows that the wire contract (proto/edgerl/v1/
// edge.proto) is all a robot controller outside Python needs, reconnects included.
//
//   edgerl_cpp_client --server HOST:PORT [--steps N] [--hz HZ] [--session ID]
//                     [--answer-timeout-s S] [--reconnect-s S]
//                     [--token TOKEN] [--ca CA.pem [--cert C.pem --key K.pem]]
//                     [--watchdog [--deadline-ms MS] [--refill-at N] [--fallback hold|zero]
//                                 [--estop-after N] [--max-delta D]
//                                 [--metrics-port PORT [--metrics-host HOST]]]
//
// Each step sends one StepObservation (env 0) whose observation is a deterministic test
// signal, obs[i] = sin(0.1 * step + i), and whose reward is what the previous step's action
// earned, another test signal: step k's action earns k + 1. It waits for the ActResponse
// (at most --answer-timeout-s seconds, default 2), checks the sequence number and prints one
// line: "step <n> version <v> obs <...> action <...> queue_wait_us <us>". The last line is
// "OK steps=<n> version=<v>"; any failure prints "ERROR <code> <message>" and exits 1.
//
// The loop waits for each answer. With --watchdog it does not: a control loop ticks at --hz
// behind a safety watchdog (watchdog.h) while a thread of its own talks to the server
// (edgerl::ControlStream, edge_stream.h), as edgerl's robot host does (see RunWatchdog below).
// Both headers are for any C++ controller to include. SIGUSR1 resets a latched e-stop.
// --metrics-port answers GET /metrics on that port of --metrics-host (default 127.0.0.1; 0: a
// free port) with the watchdog's and the stream's figures, named as `edgerl robot` names them
// (metrics.h), so that the project's Grafana dashboard and alerting rules cover this controller.
// It binds before anything else and prints "metrics http://HOST:PORT/metrics"; a port it cannot
// bind ends the program with status 2, naming it.
//
// Where the stream breaks with UNAVAILABLE (the server restarted, the network dropped the
// connection) or DEADLINE_EXCEEDED (an answer overdue, or the stream's hello not at the server
// in time: a link that died without closing its connection), the client opens a new stream,
// on a new connection, within --reconnect-s seconds (default 10; 0: never), backing off from
// 50 ms to 1 s with jitter, and prints "reconnect <n> after <code> <message>". The new stream
// resumes the session (StreamHello.mid_episode and resumes): the request whose answer did
// not come goes again, numbered as before (StepObservation.obs_index, the step), so the
// server loses no step of the episode and completes each with its own reward.
#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "edge_stream.h"
#include "edgerl/v1/edge.grpc.pb.h"
#include "metrics.h"
#include "watchdog.h"

namespace {

using edgerl::AddAuth;
using edgerl::Alarm;
using edgerl::Floats;
using edgerl::Hello;
using edgerl::Now;
using edgerl::Seconds;
using edgerl::StepRequest;
using edgerl::StubFactory;

// The options of the command line: those of the stream (session, token, answer timeout,
// reconnect window) and the rest.
struct Options : edgerl::StreamOptions {
  std::string server = "127.0.0.1:50051";
  int steps = 10;
  double hz = 0.0;  // 0: as fast as the server answers
  std::string ca, cert, key;
  // --watchdog: the fixed-rate loop behind a safety watchdog, which never waits for an answer.
  bool watchdog = false;
  // An answer later than this after its observation is not applied; default: 20 ms, or the
  // span of the server's chunk of K actions (K / hz).
  std::optional<double> deadline_ms;
  // Ask for the next answer when this many actions or fewer are left of the one held; default:
  // 1, or half the server's chunk (as edgerl robot does).
  std::optional<int> refill_at;
  std::string fallback = "hold";  // hold | zero: what a tick without a fresh action applies
  int estop_after = 50;  // consecutive fallbacks that latch an e-stop; 0: never
  double max_delta = 0.0;  // largest change of an action entry per tick; 0: 25 % of its range
  std::optional<int> metrics_port;  // GET /metrics on this port; 0: a free one
  std::optional<std::string> metrics_host;  // the address it binds; default 127.0.0.1
  std::string watchdog_option;  // the first watchdog option given (refused without --watchdog)
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The longest time an option takes (seconds, about 31 years): a steady-clock span counts
// nanoseconds in 64 bits, and overflows at 292 years.
constexpr double kMaxSeconds = 1e9;

// The value of option `name`: all of `text` a finite number in [low, high], else an error
// naming the option (std::stod alone says only "stod", and takes "5x" for 5).
double Number(const std::string& name, const std::string& text, double low, double high) {
  std::size_t used = 0;
  double v = 0.0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) {
    throw std::runtime_error(name + ": expected a number, got '" + text + "'");
  }
  if (!(v >= low && v <= high)) {  // NaN too
    std::ostringstream bounds;
    bounds << std::setprecision(15) << name << " must be a number in [" << low << ", " << high
           << "], got " << text;
    throw std::runtime_error(bounds.str());
  }
  return v;
}

int WholeNumber(const std::string& name, const std::string& text, double low, double high) {
  const double v = Number(name, text, low, high);
  if (v != std::floor(v)) throw std::runtime_error(name + ": expected a whole number, got " + text);
  return static_cast<int>(v);
}

Options Parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--server") o.server = next();
    else if (a == "--steps") o.steps = WholeNumber(a, next(), 0, 2147483647);
    else if (a == "--hz") o.hz = Number(a, next(), 0, 10000);
    else if (a == "--session") o.session = next();
    else if (a == "--answer-timeout-s") o.answer_timeout_s = Number(a, next(), 0, kMaxSeconds);
    else if (a == "--reconnect-s") o.reconnect_s = Number(a, next(), 0, kMaxSeconds);
    else if (a == "--token") o.token = next();
    else if (a == "--ca") o.ca = next();
    else if (a == "--cert") o.cert = next();
    else if (a == "--key") o.key = next();
    else if (a == "--watchdog") o.watchdog = true;
    else if (a == "--deadline-ms") o.deadline_ms = Number(a, next(), 0, kMaxSeconds * 1000);
    else if (a == "--refill-at") o.refill_at = WholeNumber(a, next(), 0, 2147483647);
    else if (a == "--fallback") o.fallback = next();
    else if (a == "--estop-after") o.estop_after = WholeNumber(a, next(), 0, 2147483647);
    else if (a == "--max-delta") o.max_delta = Number(a, next(), 0, 3.4e38);
    else if (a == "--metrics-port") o.metrics_port = WholeNumber(a, next(), 0, 65535);
    else if (a == "--metrics-host") o.metrics_host = next();
    else throw std::runtime_error("unknown option " + a);
    if (o.watchdog_option.empty() &&
        (a == "--deadline-ms" || a == "--refill-at" || a == "--fallback" || a == "--estop-after" ||
         a == "--max-delta" || a == "--metrics-port" || a == "--metrics-host")) {
      o.watchdog_option = a;
    }
  }
  if (!(o.answer_timeout_s > 0)) throw std::runtime_error("--answer-timeout-s must be > 0");
  if (!o.watchdog && !o.watchdog_option.empty()) {
    throw std::runtime_error(o.watchdog_option + " is an option of --watchdog, which is not given");
  }
  if (o.metrics_host && !o.metrics_port) {
    throw std::runtime_error("--metrics-host is the address of --metrics-port, which is not given");
  }
  if (o.watchdog && !(o.hz > 0)) throw std::runtime_error("--watchdog needs --hz > 0 (the control rate)");
  if (o.deadline_ms && !(*o.deadline_ms > 0)) throw std::runtime_error("--deadline-ms must be > 0");
  if (o.fallback != "hold" && o.fallback != "zero") {
    throw std::runtime_error("--fallback must be hold or zero, got '" + o.fallback + "'");
  }
  return o;
}

void Print(const char* label, const std::vector<float>& v) {
  std::cout << ' ' << label;
  for (float x : v) std::cout << ' ' << x;
}

int Fail(const grpc::Status& s) {
  std::cout << "ERROR " << s.error_code() << ' ' << s.error_message() << std::endl;
  return 1;
}

// The test signal a step observes: obs[i] = sin(0.1 * step + i).
std::vector<float> TestObservation(int64_t step, int64_t obs_dim) {
  std::vector<float> obs(obs_dim);
  for (int64_t i = 0; i < obs_dim; ++i) obs[i] = static_cast<float>(std::sin(0.1 * step + i));
  return obs;
}

// The operator's e-stop reset (kill -USR1 PID), as for `edgerl robot`.
volatile std::sig_atomic_t reset_asked = 0;

extern "C" void AskReset(int) { reset_asked = 1; }

// Whole lines on stdout from more than one thread.
class Printer {
 public:
  void Say(const std::string& line) {
    std::lock_guard<std::mutex> lock(mu_);
    std::cout << line << std::endl;
  }

 private:
  std::mutex mu_;
};

// The watchdog mode: tick at --hz on absolute deadlines (t0 + i / hz) and apply the
// watchdog's action at every tick, whatever the network does. A first line gives the settings:
// "watchdog hz <hz> deadline_ms <ms> refill_at <n> chunk <K> fallback <mode> estop_after <n>"
// (for a server of chunks of K > 1 the deadline and refill level are, unless given, the
// chunk's span K / hz and K / 2). Each tick prints one line: "tick <i> <policy|fallback|estop>
// version <v> age_ms <ms> at_ms <ms> action <...>" (at_ms: when it ran, since the loop's start;
// version and age_ms are "-" on fallbacks). Then it reads the robot (the test signal: tick i's
// observation is that of step i, its action earns i + 1) and, where the answer held runs low
// (--refill-at) and no request is in flight, sends the observation with all the robot earned
// since its last request (fallback set if any of those ticks fell back). A tick found more
// than a period late skips to the next one due; the ticks skipped count as loop deadline
// misses. SIGUSR1 resets a latched e-stop (the operator's reset: policy actions apply again).
// Where the stream ends for good, the watchdog latches an e-stop that no reset ends, and the
// loop runs on until the stop action is reached, then ends with ERROR. Last line: "OK
// ticks=<n> policy_ticks=<n> fallbacks=<n> late_actions=<n> loop_deadline_misses=<n>
// estops=<n> version=<v>".
int RunWatchdog(const Options& o, const edgerl::v1::DescribeResponse& info, StubFactory stubs,
                int64_t obs_dim, edgerl::MetricsServer* metrics) {
  const auto& space = info.action_space();
  int64_t act_dim = 1;
  for (int64_t d : space.shape()) act_dim *= d;
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<float> low(act_dim, static_cast<float>(-inf)), high(act_dim, static_cast<float>(inf));
  if (space.low_size() == act_dim) low.assign(space.low().begin(), space.low().end());
  if (space.high_size() == act_dim) high.assign(space.high().begin(), space.high().end());
  const int64_t chunk = std::max<int64_t>(1, info.action_chunk());
  edgerl::WatchdogConfig config;
  config.deadline_s = o.deadline_ms ? *o.deadline_ms / 1000.0 : chunk > 1 ? chunk / o.hz : 0.02;
  const int64_t refill_at = o.refill_at ? *o.refill_at : chunk > 1 ? chunk / 2 : 1;
  config.fallback = o.fallback == "zero" ? edgerl::Fallback::kZero : edgerl::Fallback::kHold;
  config.estop_after = o.estop_after;
  config.max_delta = o.max_delta;
  std::unique_ptr<edgerl::Watchdog> watchdog;
  try {
    watchdog = std::make_unique<edgerl::Watchdog>(low, high, config);
  } catch (const std::invalid_argument& e) {  // the server's action space
    std::cout << "ERROR " << grpc::StatusCode::FAILED_PRECONDITION << " action_space: " << e.what()
              << std::endl;
    return 1;
  }
  std::cout << "watchdog hz " << o.hz << " deadline_ms " << config.deadline_s * 1000 << " refill_at "
            << refill_at << " chunk " << chunk << " fallback " << o.fallback << " estop_after "
            << o.estop_after << std::endl;
  Printer out;
  edgerl::ControlStream stream(o, info, std::move(stubs), watchdog.get(),
                               [&out](const std::string& line) { out.Say(line); });
  std::signal(SIGUSR1, AskReset);
  const double period = 1.0 / o.hz;
  edgerl::RecentWindow jitter, age;  // how late each tick ran, the age of its policy action (s)
  if (metrics != nullptr) {
    metrics->SetRender([&o, &watchdog, &stream, &jitter, &age] {
      edgerl::RobotFigures f;
      f.robot = o.session;
      f.watchdog = watchdog->stats();
      f.estopped = watchdog->estopped();
      const edgerl::ControlStream::Figures s = stream.figures();
      f.policy_version = s.answered ? static_cast<int64_t>(stream.version()) : -1;
      f.tick_jitter_p50_s = jitter.Quantile(0.5);
      f.tick_jitter_p99_s = jitter.Quantile(0.99);
      f.action_age_p50_s = age.Quantile(0.5);
      f.action_age_p99_s = age.Quantile(0.99);
      f.latency_p50_s = stream.LatencyQuantile(0.5);
      f.latency_p99_s = stream.LatencyQuantile(0.99);
      f.stream_up = s.up;
      f.reconnects = s.reconnects;
      f.requests = s.requests;
      f.answers = s.answers;
      return edgerl::RobotExposition(f);
    });
  }
  const double t0 = Now();
  grpc::Status failure;
  bool failed = false;
  for (int64_t i = 0; i < o.steps; ++i) {
    std::this_thread::sleep_until(edgerl::At(t0 + i * period));
    const double now = Now();
    const auto late = static_cast<int64_t>((now - (t0 + i * period)) / period);
    if (late >= 1) {  // more than a period late: on to the tick due now
      const int64_t skip = std::min<int64_t>(late, o.steps - i);
      watchdog->Missed(skip);
      i += skip;
      if (i >= o.steps) break;
    }
    if (metrics != nullptr) jitter.Add(now - (t0 + i * period));  // for /metrics alone
    if (!failed && stream.Failed(&failure)) {
      failed = true;
      watchdog->Estop();
      std::ostringstream line;
      line << "estop the stream ended: " << failure.error_code() << ' ' << failure.error_message();
      out.Say(line.str());
    }
    if (reset_asked) {
      reset_asked = 0;
      if (failed) {
        out.Say("estop reset refused: the stream has ended");
      } else if (watchdog->estopped()) {
        watchdog->Reset();
        out.Say("estop reset");
      }
    }
    const edgerl::Tick t = watchdog->Step(i, now);
    if (metrics != nullptr && !t.fallback()) age.Add(t.age_s);
    std::ostringstream line;
    line << "tick " << i << ' ' << edgerl::TickKindName(t.kind);
    if (t.fallback()) {
      line << " version - age_ms -";
    } else {
      line << " version " << t.version << " age_ms " << std::fixed << std::setprecision(3) << t.age_s * 1e3;
    }
    line << std::fixed << std::setprecision(3) << " at_ms " << (now - t0) * 1e3 << std::defaultfloat
         << std::setprecision(6);
    line << " action";
    for (float x : t.action) line << ' ' << x;
    out.Say(line.str());
    // Read the robot (the test signal), and hand the stream what it observes and earned; it
    // asks for the next answer once the one held runs low.
    const bool ask = watchdog->Remaining() <= refill_at;
    stream.Step(i, now, TestObservation(i, obs_dim), static_cast<float>(i + 1), t.fallback(), ask);
    if (failed && watchdog->at_stop_action()) break;  // stopped safely: nothing more to do
  }
  stream.Stop();
  if (metrics != nullptr) metrics->SetRender(nullptr);  // before the watchdog and stream go
  if (failed) return Fail(failure);
  const edgerl::WatchdogStats st = watchdog->stats();
  std::cout << "OK ticks=" << st.ticks << " policy_ticks=" << st.policy_ticks << " fallbacks=" << st.fallbacks
            << " late_actions=" << st.late_actions << " loop_deadline_misses=" << st.loop_deadline_misses
            << " estops=" << st.estops << " version=" << stream.version() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = Parse(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "edgerl_cpp_client: " << e.what() << std::endl;
    return 2;
  }
  std::unique_ptr<edgerl::MetricsServer> metrics;
  if (o.metrics_port) {  // before anything else, as `edgerl robot` binds before its robots run
    const std::string host = o.metrics_host.value_or("127.0.0.1");
    try {
      metrics = std::make_unique<edgerl::MetricsServer>(host, *o.metrics_port);
    } catch (const std::exception& e) {
      std::cerr << "edgerl_cpp_client: --metrics-port: " << e.what() << std::endl;
      return 2;
    }
    const bool v6 = host.find(':') != std::string::npos;
    std::cout << "metrics http://" << (v6 ? "[" + host + "]" : host) << ':' << metrics->port()
              << "/metrics" << std::endl;
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!o.ca.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(o.ca);
    if (!o.cert.empty()) {
      ssl.pem_cert_chain = ReadFile(o.cert);
      ssl.pem_private_key = ReadFile(o.key);
    }
    creds = grpc::SslCredentials(ssl);
  }
  // Each stream gets a channel, and with it a connection, of its own (a local subchannel pool:
  // else a new channel shares the old one's connection, which may be the dead one).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  StubFactory stubs = [&o, creds, args]() {
    return edgerl::v1::EdgePolicy::NewStub(grpc::CreateCustomChannel(o.server, creds, args));
  };
  auto stub = stubs();

  // Describe: spaces, version and limits.
  edgerl::v1::DescribeResponse info;
  {
    grpc::ClientContext ctx;
    AddAuth(&ctx, o, 5.0);
    grpc::Status s = stub->Describe(&ctx, edgerl::v1::DescribeRequest(), &info);
    if (!s.ok()) return Fail(s);
  }
  int64_t obs_dim = 1;
  for (int64_t d : info.observation_space().shape()) obs_dim *= d;
  std::cout << "server " << info.server_version() << " backend " << info.backend() << " env "
            << info.env_name() << " obs_dim " << obs_dim << " act_dim "
            << info.action_space().shape(0) << " version " << info.policy_version() << std::endl;
  if (o.watchdog) return RunWatchdog(o, info, stubs, obs_dim, metrics.get());

  // The Act stream: hello first, then one step per loop iteration. A stream after the first
  // resumes the session: the envs are mid-episode, and the request left unanswered goes again.
  edgerl::ActCall call;
  call.stub = std::move(stub);  // the first stream goes on Describe's channel
  int streams = 0;
  const auto answer_timeout = Seconds(o.answer_timeout_s);
  Alarm alarm;  // after call: it stops before the call goes
  auto open = [&]() {
    // The alarm stays armed to the first step: a failure (or the alarm) shows at its write or read.
    call.Open(stubs, streams > 0, o, &alarm, Hello(o, info, streams > 0));
    ++streams;
  };
  open();

  const auto period = Seconds(o.hz > 0 ? 1.0 / o.hz : 0.0);
  const auto reconnect_for = std::chrono::duration<double>(o.reconnect_s);  // any size
  edgerl::Backoff backoff;
  auto next_tick = std::chrono::steady_clock::now();
  uint64_t version = 0;
  uint64_t seq = 0;  // this stream's: 0 for its first step
  int reconnects = 0;
  for (int step = 0; step < o.steps; ++step) {
    const std::vector<float> obs = TestObservation(step, obs_dim);
    // Its reward is what step - 1's action earned.
    edgerl::v1::ActRequest req =
        StepRequest(obs, static_cast<float>(step), false, static_cast<uint64_t>(step));
    auto* st = req.mutable_step();
    edgerl::v1::ActResponse resp;
    const auto asked = std::chrono::steady_clock::now();
    for (int attempt = 0;; ++attempt) {
      st->set_seq(seq);
      alarm.Arm(call.ctx.get(), std::chrono::steady_clock::now() + answer_timeout);
      const bool answered = call.stream->Write(req) && call.stream->Read(&resp);
      const bool overdue = alarm.Disarm();
      if (answered && !overdue) break;  // (an answer just as the alarm went off: sent again)
      grpc::Status s = call.stream->Finish();
      if (overdue) s = edgerl::Overdue(o.answer_timeout_s);
      if (!edgerl::Transient(s) || std::chrono::steady_clock::now() - asked >= reconnect_for) {
        return Fail(s);
      }
      std::cout << edgerl::ReconnectLine(++reconnects, s) << std::endl;
      std::this_thread::sleep_for(backoff.Delay(attempt));
      open();
      seq = 0;
    }
    if (resp.seq() != seq) {
      std::cout << "ERROR protocol answer for seq " << resp.seq() << ", expected " << seq
                << std::endl;
      return 1;
    }
    ++seq;
    version = resp.policy_version();
    std::cout << "step " << step << " version " << version;
    Print("obs", obs);
    Print("action", Floats(resp.actions()));
    std::cout << " queue_wait_us " << resp.queue_wait_us() << std::endl;
    if (o.hz > 0) {
      next_tick += period;  // absolute deadlines: no drift
      const auto now = std::chrono::steady_clock::now();
      if (next_tick < now) next_tick = now;  // after an outage, no burst of ticks to catch up
      std::this_thread::sleep_until(next_tick);
    }
  }
  call.stream->WritesDone();
  grpc::Status s = call.stream->Finish();
  if (!s.ok()) return Fail(s);
  std::cout << "OK steps=" << o.steps << " version=" << version << std::endl;
  return 0;
}
