// The fiber scheduler behind shim.h, and a generic launcher: a kernel's parameters arrive as an array of
// pointers to their values (as cuLaunchKernel takes them) and are unpacked by the kernel's own signature.
#include "shim.h"

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emu {

constexpr size_t kStack = 256 * 1024;

struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    bool done = false;
};

static ucontext_t sched;
static std::vector<Fiber> fibers;
static unsigned current = 0;
static unsigned long long progress = 0;  // barrier arrivals and completions, finished fibers
static unsigned cta_arrived = 0, cta_gen = 0;
static std::vector<unsigned> warp_arrived, warp_gen, shfl_calls;
static std::vector<float> shfl_buf;
static void (*body)(void*) = nullptr;
static void* body_arg = nullptr;

static void yield() { swapcontext(&fibers[current].ctx, &sched); }

static void barrier(unsigned& arrived, unsigned& gen, unsigned n) {
    const unsigned mine = gen;
    ++progress;
    if (++arrived == n) {
        arrived = 0;
        ++gen;
        return;
    }
    while (gen == mine) yield();
}

static void entry() {
    body(body_arg);
    fibers[current].done = true;
    ++progress;
}  // returns to uc_link (the scheduler)

static void run_cta(void (*fn)(void*), void* arg, unsigned n) {
    body = fn;
    body_arg = arg;
    if (fibers.size() < n) fibers.resize(n);
    warp_arrived.assign((n + 31) / 32, 0);
    warp_gen.assign((n + 31) / 32, 0);
    shfl_calls.assign(n, 0);
    shfl_buf.assign(2 * n, 0.f);
    cta_arrived = 0;
    for (unsigned i = 0; i < n; ++i) {
        Fiber& f = fibers[i];
        if (f.stack.empty()) f.stack.resize(kStack);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &sched;
        makecontext(&f.ctx, entry, 0);
        f.done = false;
    }
    unsigned remaining = n;
    while (remaining) {
        const unsigned long long before = progress;
        for (unsigned i = 0; i < n; ++i) {
            if (fibers[i].done) continue;
            current = i;
            threadIdx = dim3{i, 0, 0};
            swapcontext(&sched, &fibers[i].ctx);
            if (fibers[i].done) --remaining;
        }
        if (remaining && progress == before) {
            std::fprintf(stderr, "cuda emulator: deadlock in CTA (%u,%u,%u): threads wait at a barrier others skip\n",
                         blockIdx.x, blockIdx.y, blockIdx.z);
            std::abort();
        }
    }
}

template <typename... Args, std::size_t... I>
std::tuple<Args...> unpack(void** params, std::index_sequence<I...>) {
    return std::tuple<Args...>(*static_cast<std::remove_reference_t<Args>*>(params[I])...);
}

template <typename... Args>
void launch(void (*kernel)(Args...), dim3 grid, dim3 block, void** params) {
    std::tuple<Args...> args = unpack<Args...>(params, std::index_sequence_for<Args...>{});
    struct Call {
        void (*kernel)(Args...);
        std::tuple<Args...>* args;
    } call{kernel, &args};
    auto run = [](void* p) {
        auto* c = static_cast<Call*>(p);
        std::apply(c->kernel, *c->args);
    };
    blockDim = block;
    gridDim = grid;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = dim3{x, y, z};
                run_cta(run, &call, block.x);
            }
}

}  // namespace emu

void __syncthreads() { emu::barrier(emu::cta_arrived, emu::cta_gen, blockDim.x); }

// Double-buffered by call parity: a lane cannot overwrite a buffer its warp may still read, because it must
// first pass the next call's barrier, which needs every lane to have finished this call.
float __shfl_xor_sync(unsigned int, float value, int lane_mask) {
    const unsigned t = threadIdx.x, warp = t / 32, n = blockDim.x;
    const unsigned phase = emu::shfl_calls[t]++ & 1u;
    emu::shfl_buf[phase * n + t] = value;
    emu::barrier(emu::warp_arrived[warp], emu::warp_gen[warp], 32);
    return emu::shfl_buf[phase * n + warp * 32 + ((t % 32) ^ (unsigned)lane_mask)];
}
