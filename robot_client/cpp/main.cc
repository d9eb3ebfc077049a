// edgerl_cpp_client: stream observations to an edgerl edge server from a fixed-rate loop
// and print the actions that come back. It shows that the wire contract (proto/edgerl/v1/
// edge.proto) is all a robot controller outside Python needs, reconnects included.
//
//   edgerl_cpp_client --server HOST:PORT [--steps N] [--hz HZ] [--session ID]
//                     [--answer-timeout-s S] [--reconnect-s S]
//                     [--token TOKEN] [--ca CA.pem [--cert C.pem --key K.pem]]
//
// Each step sends one StepObservation (env 0) whose observation is a deterministic test
// signal, obs[i] = sin(0.1 * step + i), and whose reward is what the previous step's action
// earned, another test signal: step k's action earns k + 1. It waits for the ActResponse
// (at most --answer-timeout-s seconds, default 2), checks the sequence number and prints one
// line: "step <n> version <v> obs <...> action <...> queue_wait_us <us>". The last line is
// "OK steps=<n> version=<v>"; any failure prints "ERROR <code> <message>" and exits 1.
//
// The loop waits for each answer: a controller that must act at every tick whatever the
// network does runs a watchdog beside the stream, as edgerl's robot host does.
//
// Where the stream breaks with UNAVAILABLE (the server restarted, the network dropped the
// connection) or an answer is overdue (a link that died without closing its connection), the
// client opens a new stream, on a new connection, within --reconnect-s seconds (default 10;
// 0: never), backing off from 50 ms to 1 s with jitter, and prints "reconnect <n> after
// <code> <message>" (code 4, DEADLINE_EXCEEDED, for an overdue answer). The new stream
// resumes the session (StreamHello.mid_episode and resumes): the request whose answer did
// not come goes again, numbered as before (StepObservation.obs_index, the step), so the
// server loses no step of the episode and completes each with its own reward.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "edgerl/v1/edge.grpc.pb.h"

namespace {

struct Options {
  std::string server = "127.0.0.1:50051";
  int steps = 10;
  double hz = 0.0;  // 0: as fast as the server answers
  double answer_timeout_s = 2.0;  // an answer later than this ends the stream as broken
  double reconnect_s = 10.0;  // how long to keep trying to resume a broken stream; 0: never
  std::string session = "cpp-client";
  std::string token;
  std::string ca, cert, key;
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
    else throw std::runtime_error("unknown option " + a);
  }
  if (!(o.answer_timeout_s > 0)) throw std::runtime_error("--answer-timeout-s must be > 0");
  return o;
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
edgerl::v1::Tensor Float32(const std::vector<float>& values, const std::vector<int64_t>& shape) {
  edgerl::v1::Tensor t;
  t.set_dtype(edgerl::v1::FLOAT32);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(values.data(), values.size() * sizeof(float));
  return t;
}

std::vector<float> Floats(const edgerl::v1::Tensor& t) {
  if (t.dtype() != edgerl::v1::FLOAT32) throw std::runtime_error("actions: expected FLOAT32");
  std::vector<float> out(t.data().size() / sizeof(float));
  std::memcpy(out.data(), t.data().data(), out.size() * sizeof(float));
  return out;
}

void Print(const char* label, const std::vector<float>& v) {
  std::cout << ' ' << label;
  for (float x : v) std::cout << ' ' << x;
}

int Fail(const grpc::Status& s) {
  std::cout << "ERROR " << s.error_code() << ' ' << s.error_message() << std::endl;
  return 1;
}

// A span of the steady clock from seconds.
std::chrono::steady_clock::duration Seconds(double s) {
  using std::chrono::duration;
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(duration<double>(s));
}

void AddAuth(grpc::ClientContext* ctx, const Options& o, double deadline_s) {
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000)));
  if (!o.token.empty()) ctx->AddMetadata("authorization", "Bearer " + o.token);
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
  auto stub = edgerl::v1::EdgePolicy::NewStub(grpc::CreateCustomChannel(o.server, creds, args));

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

  // The Act stream: hello first, then one step per loop iteration. A stream after the first
  // resumes the session: the envs are mid-episode, and the request left unanswered goes again.
  using Stream = grpc::ClientReaderWriter<edgerl::v1::ActRequest, edgerl::v1::ActResponse>;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::unique_ptr<Stream> stream;
  int streams = 0;
  const auto answer_timeout = Seconds(o.answer_timeout_s);
  Alarm alarm;  // after ctx and stream: it stops before they go
  auto open = [&]() {
    stream.reset();  // the finished call before its context, and both before their channel
    ctx.reset();
    if (streams > 0) {
      stub = edgerl::v1::EdgePolicy::NewStub(grpc::CreateCustomChannel(o.server, creds, args));
    }
    ctx = std::make_unique<grpc::ClientContext>();
    AddAuth(ctx.get(), o, 3600.0);
    alarm.Arm(ctx.get(), std::chrono::steady_clock::now() + answer_timeout);  // to the 1st step
    stream = stub->Act(ctx.get());  // waits for the connection
    edgerl::v1::ActRequest hello;
    auto* h = hello.mutable_hello();
    h->set_session_id(o.session);
    h->set_env_name(info.env_name());
    h->set_num_envs(1);
    for (int64_t d : info.observation_space().shape()) h->add_obs_shape(d);
    h->set_max_inflight(1);
    h->set_mid_episode(streams > 0);
    h->set_resumes(true);
    ++streams;
    stream->Write(hello);  // a failure (or the alarm) shows at the first step's write or read
  };
  open();

  const auto period = Seconds(o.hz > 0 ? 1.0 / o.hz : 0.0);
  const auto reconnect_for = std::chrono::duration<double>(o.reconnect_s);  // any size
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<double> jitter(0.5, 1.0);
  auto next_tick = std::chrono::steady_clock::now();
  uint64_t version = 0;
  uint64_t seq = 0;  // this stream's: 0 for its first step
  int reconnects = 0;
  for (int step = 0; step < o.steps; ++step) {
    std::vector<float> obs(obs_dim);
    for (int64_t i = 0; i < obs_dim; ++i) obs[i] = static_cast<float>(std::sin(0.1 * step + i));
    edgerl::v1::ActRequest req;
    auto* st = req.mutable_step();
    st->add_env_ids(0);
    *st->mutable_obs() = Float32(obs, {1, obs_dim});
    st->add_rewards(static_cast<float>(step));  // what step - 1's action earned
    st->add_terminated(false);
    st->add_truncated(false);
    st->add_obs_index(static_cast<uint64_t>(step));
    edgerl::v1::ActResponse resp;
    const auto asked = std::chrono::steady_clock::now();
    for (int attempt = 0;; ++attempt) {
      st->set_seq(seq);
      alarm.Arm(ctx.get(), std::chrono::steady_clock::now() + answer_timeout);
      const bool answered = stream->Write(req) && stream->Read(&resp);
      const bool overdue = alarm.Disarm();
      if (answered && !overdue) break;  // (an answer just as the alarm went off: sent again)
      grpc::Status s = stream->Finish();
      if (overdue) {
        std::ostringstream why;
        why << "no answer within " << o.answer_timeout_s << " s";
        s = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, why.str());
      }
      const bool transient = s.error_code() == grpc::StatusCode::UNAVAILABLE || overdue;
      if (!transient || std::chrono::steady_clock::now() - asked >= reconnect_for) {
        return Fail(s);
      }
      std::cout << "reconnect " << ++reconnects << " after " << s.error_code() << ' '
                << s.error_message() << std::endl;
      // Jitter: a fleet that lost its server together does not come back in lockstep.
      const double backoff_ms = std::min(50 << std::min(attempt, 5), 1000) * jitter(rng);
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(backoff_ms));
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
  stream->WritesDone();
  grpc::Status s = stream->Finish();
  if (!s.ok()) return Fail(s);
  std::cout << "OK steps=" << o.steps << " version=" << version << std::endl;
  return 0;
}
