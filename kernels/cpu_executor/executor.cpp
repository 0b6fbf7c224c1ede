// The CPU executor's scheduler: one launch runs its blocks one after another; a block's threads
// are fibers (ucontext to start, _setjmp/_longjmp to switch: no signal-mask system call per
// switch) that yield at __syncthreads and __shfl_xor_sync. Two schedules:
//   lockstep  (0): round robin over the block's threads in index order, one step (to the next
//                  barrier or exchange) each;
//   run-ahead (1): the warps in reverse order, each run alone until all its threads wait at a
//                  block barrier (or are done), its exchanges resolved as they come.
// A kernel that needs a barrier it lacks reads stale shared memory under one of them. Threads
// waiting at different barriers, an exchange that not all 32 lanes reach, or a barrier that some
// threads have left the kernel without, is reported as an error (CUDA leaves these undefined).
// Faults (a guard page, an alignment trap) inside a launch are caught and reported with the
// thread that faulted, so a test fails instead of the process dying.
#include <csetjmp>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

#include "cuda_on_cpu.h"

namespace emu {
emu_dim3 thread_idx, block_idx, block_dim, grid_dim;

namespace {
struct Kernel { std::string name; Thunk thunk; const Param* params; int arity; };
std::vector<Kernel>& kernels() { static std::vector<Kernel> k; return k; }

enum State { READY, BARRIER, EXCHANGE, DONE };
const size_t STACK = 64 * 1024;

struct Fiber {
  ucontext_t uc;
  jmp_buf jb;
  char* stack = nullptr;        // STACK bytes above one guard page
  bool started = false;
  State state = READY;
  const char* file = "";
  int line = 0;
  unsigned value = 0;           // this lane's exchange value, then its result
  int lane_mask = 0;
};

struct Launch {
  Thunk thunk = nullptr;
  void** args = nullptr;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  jmp_buf scheduler;
  std::string error;
} L;

std::mutex launch_lock;
sigjmp_buf fault_return;
volatile sig_atomic_t fault_signal = 0;
void* volatile fault_address = nullptr;
char alt_stack[64 * 1024];

void fail(const std::string& what) {
  if (L.error.empty()) L.error = what;
}

std::string where() {
  char buf[160];
  snprintf(buf, sizeof buf, "block %u thread %u", block_idx.x, thread_idx.x);
  return buf;
}

void yield() {
  if (!_setjmp(L.current->jb)) _longjmp(L.scheduler, 1);
}

void fiber_main() {
  for (;;) {                    // one kernel call per block; the next block resumes here
    L.thunk(L.args);
    L.current->state = DONE;
    yield();
  }
}

void resume(Fiber& f, unsigned tid) {
  L.current = &f;
  thread_idx = {tid, 0, 0};
  f.state = READY;
  if (!_setjmp(L.scheduler)) {
    if (!f.started) {
      f.started = true;
      setcontext(&f.uc);
    }
    _longjmp(f.jb, 1);
  }
}

void prepare_fibers(unsigned threads) {
  static std::vector<char*> stacks;
  while (stacks.size() < threads) {
    const long page = sysconf(_SC_PAGESIZE);
    char* base = (char*)mmap(nullptr, STACK + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw std::bad_alloc();
    mprotect(base, page, PROT_NONE);            // a stack overflow faults instead of writing elsewhere
    stacks.push_back(base + page);
  }
  L.fibers.assign(threads, Fiber());
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = L.fibers[t];
    f.stack = stacks[t];
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = STACK;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, fiber_main, 0);
  }
}

std::string site(const Fiber& f) { return std::string(f.file) + ":" + std::to_string(f.line); }

// Resolve the exchange of warp w if all its lanes wait at one; false if not all are there yet.
bool exchange(unsigned w, unsigned threads) {
  const unsigned first = w * 32, last = first + 32;
  if (last > threads) {
    for (unsigned t = first; t < threads; ++t)
      if (L.fibers[t].state == EXCHANGE)
        fail("__shfl_xor_sync with a full mask in a partial warp (blockDim.x = " + std::to_string(threads) + ")");
    return false;
  }
  for (unsigned t = first; t < last; ++t)
    if (L.fibers[t].state != EXCHANGE) return false;
  const Fiber& lead = L.fibers[first];
  unsigned in[32];
  for (unsigned t = first; t < last; ++t) {
    const Fiber& f = L.fibers[t];
    if (f.line != lead.line || std::strcmp(f.file, lead.file) != 0 || f.lane_mask != lead.lane_mask) {
      fail("warp " + std::to_string(w) + " diverged at __shfl_xor_sync: lane 0 at " + site(lead) + ", lane " +
           std::to_string(t - first) + " at " + site(f));
      return false;
    }
    in[t - first] = f.value;
  }
  for (unsigned t = first; t < last; ++t) {
    Fiber& f = L.fibers[t];
    f.value = in[(t - first) ^ (unsigned)f.lane_mask];
    f.state = READY;
  }
  return true;
}

// Warps whose lanes wait at an exchange that some lane will never reach.
void check_stuck_exchanges(unsigned threads) {
  for (unsigned t = 0; t < threads; ++t) {
    const Fiber& f = L.fibers[t];
    if (f.state != EXCHANGE) continue;
    for (unsigned o = t & ~31u; o < (t & ~31u) + 32 && o < threads; ++o)
      if (L.fibers[o].state == BARRIER || L.fibers[o].state == DONE) {
        fail("thread " + std::to_string(t) + " waits at __shfl_xor_sync (" + site(f) + ") that lane " +
             std::to_string(o & 31) + " of its warp never reaches (it is " +
             (L.fibers[o].state == DONE ? "done" : "at a barrier, " + site(L.fibers[o])) + ")");
        return;
      }
  }
}

// All live threads at one barrier: release them. False (with an error) when they are not.
bool barrier(unsigned threads) {
  const Fiber* lead = nullptr;
  unsigned done = 0;
  for (unsigned t = 0; t < threads; ++t) {
    const Fiber& f = L.fibers[t];
    if (f.state == DONE) { ++done; continue; }
    if (f.state != BARRIER) return false;
    if (!lead) lead = &f;
    else if (f.line != lead->line || std::strcmp(f.file, lead->file) != 0) {
      fail("deadlock: threads wait at different barriers (" + site(*lead) + " and thread " + std::to_string(t) +
           " at " + site(f) + ")");
      return false;
    }
  }
  if (!lead) return false;
  if (done) {
    fail("deadlock: " + std::to_string(threads - done) + " threads wait at the barrier " + site(*lead) + " that " +
         std::to_string(done) + " threads have left the kernel without reaching");
    return false;
  }
  for (Fiber& f : L.fibers) f.state = READY;
  return true;
}

void run_block(unsigned threads, int schedule) {
  const unsigned warps = (threads + 31) / 32;
  for (Fiber& f : L.fibers) f.state = READY;
  for (;;) {
    bool ran = false;
    if (schedule == 0) {
      for (unsigned t = 0; t < threads; ++t)
        if (L.fibers[t].state == READY) { resume(L.fibers[t], t); ran = true; }
    } else {
      for (unsigned w = warps; w-- > 0;) {
        const unsigned first = w * 32, last = first + 32 < threads ? first + 32 : threads;
        for (bool again = true; again && L.error.empty();) {
          again = false;
          for (unsigned t = first; t < last; ++t)
            if (L.fibers[t].state == READY) { resume(L.fibers[t], t); ran = again = true; }
          if (!again && exchange(w, threads)) again = true;
        }
      }
    }
    if (!L.error.empty()) return;
    bool exchanged = false;
    for (unsigned w = 0; w < warps; ++w) exchanged |= exchange(w, threads);
    if (!L.error.empty()) return;
    if (ran || exchanged) continue;
    bool all_done = true;
    for (const Fiber& f : L.fibers) all_done &= f.state == DONE;
    if (all_done) return;
    if (barrier(threads)) continue;
    if (L.error.empty()) check_stuck_exchanges(threads);
    if (L.error.empty()) fail("deadlock: no thread can run (threads wait at a barrier while others wait to exchange)");
    return;
  }
}

void on_fault(int sig, siginfo_t* info, void*) {
  fault_signal = sig;
  fault_address = info->si_addr;
  siglongjmp(fault_return, 1);
}
}  // namespace

void syncthreads(const char* file, int line) {
  Fiber& f = *L.current;
  f.state = BARRIER;
  f.file = file;
  f.line = line;
  yield();
}

unsigned shfl_xor(unsigned mask, unsigned bits, int lane_mask, const char* file, int line) {
  Fiber& f = *L.current;
  if (mask != 0xffffffffu || lane_mask < 0 || lane_mask > 31) {
    fail(std::string("__shfl_xor_sync at ") + file + ":" + std::to_string(line) +
         ": only the full mask and lane masks 0..31 are supported");
  }
  f.state = EXCHANGE;
  f.file = file;
  f.line = line;
  f.value = bits;
  f.lane_mask = lane_mask;
  yield();
  return f.value;
}

void register_kernel(const char* name, Thunk thunk, const Param* params, int arity) {
  kernels().push_back({name, thunk, params, arity});
}
}  // namespace emu

using namespace emu;

extern "C" {
int emu_kernel_count() { return (int)kernels().size(); }
const char* emu_kernel_name(int k) { return kernels()[k].name.c_str(); }
int emu_kernel_arity(int k) { return kernels()[k].arity; }
// kind ('p', 'f', 'i') of parameter p of kernel k; its size in bytes through `size`
int emu_kernel_param(int k, int p, int* size) {
  *size = kernels()[k].params[p].size;
  return kernels()[k].params[p].kind;
}

// Run kernel k on a grid of `grid` blocks of `block` threads. Returns 0, or 1 with a message in
// `err` (a deadlock, a divergent exchange), or 2 with a fault: the signal and faulting address
// through `sig` and `addr`, the block and thread in `err`.
int emu_launch(int k, unsigned grid, unsigned block, void** args, int schedule, char* err, int err_len, int* sig,
               void** addr) {
  std::lock_guard<std::mutex> hold(launch_lock);
  L.thunk = kernels()[k].thunk;
  L.args = args;
  L.error.clear();
  grid_dim = {grid, 1, 1};
  block_dim = {block, 1, 1};
  prepare_fibers(block);

  stack_t alt{}, old_alt{};
  alt.ss_sp = alt_stack;
  alt.ss_size = sizeof alt_stack;
  sigaltstack(&alt, &old_alt);
  struct sigaction act{}, old[4];
  const int sigs[4] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE};
  act.sa_sigaction = on_fault;
  act.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&act.sa_mask);
  for (int i = 0; i < 4; ++i) sigaction(sigs[i], &act, &old[i]);
  int status = 0;
  fault_signal = 0;
  if (sigsetjmp(fault_return, 1) == 0) {
    for (unsigned b = 0; b < grid && L.error.empty(); ++b) {
      block_idx = {b, 0, 0};
      run_block(block, schedule);
    }
    status = L.error.empty() ? 0 : 1;
  } else {
    status = 2;
    *sig = fault_signal;
    *addr = fault_address;
    L.error = where();
  }
  for (int i = 0; i < 4; ++i) sigaction(sigs[i], &old[i], nullptr);
  sigaltstack(&old_alt, nullptr);
  if (status) snprintf(err, err_len, "%s", L.error.c_str());
  return status;
}

// A mapping for one argument: `bytes` rounded up to whole pages, between two inaccessible pages.
// Returns its start (the first guard page); its length through `len`, for emu_free.
void* emu_map_guarded(size_t bytes, size_t* len) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), data = (bytes + page - 1) / page * page;
  *len = data + 2 * page;
  char* m = (char*)mmap(nullptr, *len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  mprotect(m, page, PROT_NONE);
  mprotect(m + page + data, page, PROT_NONE);
  return m;
}

void emu_free(void* base, size_t len) { munmap(base, len); }

// The host conversions, for their tests
void emu_to_half(const float* x, unsigned short* y, long n) { for (long i = 0; i < n; ++i) y[i] = float_to_half_bits(x[i]); }
void emu_to_bf16(const float* x, unsigned short* y, long n) { for (long i = 0; i < n; ++i) y[i] = float_to_bf16_bits(x[i]); }
void emu_from_half(const unsigned short* x, float* y, long n) { for (long i = 0; i < n; ++i) y[i] = half_bits_to_float(x[i]); }
}
