// GET /metrics for a C++ robot controller, in Prometheus's text format (version 0.0.4), on a
// thread of its own: the watchdog's counters and its stream's, under the names and labels of
// `edgerl robot`'s own /metrics, so that docs/grafana-dashboard.json and
// docs/prometheus-alerts.yml cover a C++ controller as they cover a Python robot host.
// Header only: POSIX sockets and the standard library (and watchdog.h for its counters).
#pragma once

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "watchdog.h"

namespace edgerl {

// One robot's figures at a scrape.
struct RobotFigures {
  std::string robot;  // the `robot` label: the session's name
  WatchdogStats watchdog;
  bool estopped = false;
  int64_t policy_version = -1;  // of the last answer; -1: none yet
  // Recent figures' p50 and p99 (seconds; NaN where none yet): how late ticks ran, the age of
  // the policy actions applied, and the time from an observation to its answer.
  double tick_jitter_p50_s = std::numeric_limits<double>::quiet_NaN();
  double tick_jitter_p99_s = std::numeric_limits<double>::quiet_NaN();
  double action_age_p50_s = std::numeric_limits<double>::quiet_NaN();
  double action_age_p99_s = std::numeric_limits<double>::quiet_NaN();
  double latency_p50_s = std::numeric_limits<double>::quiet_NaN();
  double latency_p99_s = std::numeric_limits<double>::quiet_NaN();
  bool stream_up = false;
  int64_t reconnects = 0;  // streams that failed or could not open
  int64_t requests = 0;  // observations sent
  int64_t answers = 0;  // answers taken in
};

// A label value as the text format writes it: backslash, double quote and newline escaped.
inline std::string LabelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

inline std::string SampleValue(double v) {
  if (std::isnan(v)) return "NaN";
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

// `f` in Prometheus's text format, each family as `edgerl robot` writes it.
inline std::string RobotExposition(const RobotFigures& f) {
  std::ostringstream out;
  const std::string robot = "robot=\"" + LabelValue(f.robot) + "\"";
  auto family = [&out](const char* name, const char* type, const char* help) {
    out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  };
  auto per_robot = [&](const char* name, const char* type, const char* help, int64_t v) {
    family(name, type, help);
    out << name << '{' << robot << "} " << v << '\n';
  };
  const WatchdogStats& w = f.watchdog;
  per_robot("edgerl_robot_ticks_total", "counter", "Control ticks run.", w.ticks);
  per_robot("edgerl_robot_policy_ticks_total", "counter", "Ticks that applied a policy action.",
            w.policy_ticks);
  per_robot("edgerl_robot_fallbacks_total", "counter", "Ticks that applied a fallback action: none in time.",
            w.fallbacks);
  per_robot("edgerl_robot_estops_total", "counter", "E-stops latched.", w.estops);
  per_robot("edgerl_robot_loop_deadline_misses_total", "counter", "Ticks the loop skipped, a period late.",
            w.loop_deadline_misses);
  per_robot("edgerl_robot_late_actions_total", "counter", "Answers dropped: they came after their deadline.",
            w.late_actions);
  per_robot("edgerl_robot_requests_total", "counter", "Observations sent to the server.", f.requests);
  per_robot("edgerl_robot_answers_total", "counter", "Answers from the server.", f.answers);
  per_robot("edgerl_robot_estopped", "gauge",
            "1 while the robot's e-stop is latched (until the operator's reset).", f.estopped ? 1 : 0);
  per_robot("edgerl_robot_policy_version", "gauge", "Version of the policy's last answer (-1: none yet).",
            f.policy_version);
  per_robot("edgerl_robot_max_consecutive_fallbacks", "gauge", "Longest fallback streak.",
            w.max_consecutive_fallbacks);
  auto quantiles = [&](const char* name, const char* help, double p50, double p99) {
    family(name, "gauge", help);
    out << name << '{' << robot << ",quantile=\"0.5\"} " << SampleValue(p50) << '\n';
    out << name << '{' << robot << ",quantile=\"0.99\"} " << SampleValue(p99) << '\n';
  };
  quantiles("edgerl_robot_tick_jitter_seconds", "How late ticks started, recent ticks by quantile.",
            f.tick_jitter_p50_s, f.tick_jitter_p99_s);
  quantiles("edgerl_robot_action_age_seconds", "Age of the actions applied, by quantile.", f.action_age_p50_s,
            f.action_age_p99_s);
  quantiles("edgerl_robot_latency_seconds", "Observation to answer, recent answers by quantile.",
            f.latency_p50_s, f.latency_p99_s);
  family("edgerl_robot_stream_up", "gauge", "1 while the Act stream is up.");
  out << "edgerl_robot_stream_up " << (f.stream_up ? 1 : 0) << '\n';
  family("edgerl_robot_stream_reconnects_total", "counter", "Streams that failed or could not open.");
  out << "edgerl_robot_stream_reconnects_total " << f.reconnects << '\n';
  return out.str();
}

// Serves GET /metrics on host:port from a thread of its own: the text `render` gives at each
// request (an empty page until SetRender). Any other path is 404, any other method 405; a
// request whose head is past 8 KiB, or not in within 2 s, is closed. One request a connection.
class MetricsServer {
 public:
  // Binds host:port (port 0: a free one; host "0.0.0.0": every interface). Throws
  // std::runtime_error naming the address and the system's reason where it cannot.
  MetricsServer(const std::string& host, int port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string where = host + ":" + std::to_string(port);
    const int err = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    if (err != 0) throw std::runtime_error("cannot listen on " + where + ": " + gai_strerror(err));
    std::string why = "no address";
    for (addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
      const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) {
        why = std::strerror(errno);
        continue;
      }
      const int one = 1;
      setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      if (bind(fd, a->ai_addr, a->ai_addrlen) == 0 && listen(fd, 16) == 0) {
        fd_ = fd;
      } else {
        why = std::strerror(errno);
        close(fd);
      }
    }
    freeaddrinfo(found);
    if (fd_ < 0) throw std::runtime_error("cannot listen on " + where + ": " + why);
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    thread_ = std::thread([this] { Run(); });
  }
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;
  ~MetricsServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    close(fd_);
  }

  int port() const { return port_; }

  void SetRender(std::function<std::string()> render) {
    std::lock_guard<std::mutex> lock(mu_);
    render_ = std::move(render);
  }

 private:
  void Run() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;  // 100 ms: how soon it sees stop_
      const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      Answer(conn);
      close(conn);
    }
  }

  void Answer(int conn) {
    std::string head;
    char buf[1024];
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (head.find("\r\n\r\n") == std::string::npos && head.size() <= 8192) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      pollfd p{conn, POLLIN, 0};
      if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) return;
      const ssize_t n = recv(conn, buf, sizeof(buf), 0);
      if (n <= 0) return;
      head.append(buf, static_cast<std::size_t>(n));
    }
    if (head.size() > 8192) return Send(conn, 431, "request head too large\n");
    std::istringstream first(head.substr(0, head.find("\r\n")));
    std::string method, target;
    first >> method >> target;
    const std::string path = target.substr(0, target.find('?'));
    if (path != "/metrics") return Send(conn, 404, "only /metrics is served\n");
    if (method != "GET") return Send(conn, 405, "only GET is served\n");
    std::function<std::string()> render;
    {
      std::lock_guard<std::mutex> lock(mu_);
      render = render_;
    }
    Send(conn, 200, render ? render() : std::string());
  }

  static void Send(int conn, int code, const std::string& body) {
    const char* reason = code == 200   ? "OK"
                         : code == 404 ? "Not Found"
                         : code == 405 ? "Method Not Allowed"
                                       : "Request Header Fields Too Large";
    std::ostringstream out;
    out << "HTTP/1.1 " << code << ' ' << reason << "\r\n"
        << "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        << "Content-Length: " << body.size() << "\r\nConnection: close\r\n\r\n"
        << body;
    const std::string all = out.str();
    for (std::size_t sent = 0; sent < all.size();) {
      const ssize_t n = send(conn, all.data() + sent, all.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return;
      sent += static_cast<std::size_t>(n);
    }
  }

  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::function<std::string()> render_;
  std::thread thread_;  // last: it starts once the members above are set
};

}  // namespace edgerl
