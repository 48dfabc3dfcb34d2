// Issue 12 experiment: can the copy engines, fed through cudaMemcpyBatchAsync (CUDA >= 12.8),
// move whole KV blocks between a device pool and a contiguous pinned buffer at >= 96 % of one
// large pinned copy? One piece = one (layer, K/V, block) run of BS * NH * HS * 2 bytes
// (Llama-3-8B: NH 8, HS 128, bf16; 32 layers), blocks in random order from a pool twice the size.
// Build and run on a GPU machine (results are JSON lines; docs/bench_data/memcpy_batch_h200.jsonl):
//   nvcc -O2 -arch=sm_90 -o /tmp/bc scripts/gpu_memcpy_batch.cu && /tmp/bc
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <random>
#include <chrono>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("ERR %s line %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); return 1; } } while (0)
static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int run(size_t piece, size_t T, size_t BS, int reps) {
  const size_t NL = 32, KV = 2, nblk = T / BS, pool = 2 * nblk;
  const size_t total = KV * NL * nblk * piece;
  char *dev, *host;
  CK(cudaMalloc(&dev, KV * NL * pool * piece));
  CK(cudaHostAlloc((void**)&host, total, cudaHostAllocDefault));
  CK(cudaMemset(dev, 1, KV * NL * pool * piece));
  std::vector<size_t> blocks(pool); for (size_t i = 0; i < pool; ++i) blocks[i] = i;
  std::mt19937 g(0); std::shuffle(blocks.begin(), blocks.end(), g); blocks.resize(nblk);
  size_t n = KV * NL * nblk;
  std::vector<void*> d2h_dst(n), h2d_dst(n); std::vector<const void*> d2h_src(n), h2d_src(n); std::vector<size_t> sizes(n, piece);
  size_t k = 0;
  for (size_t kv = 0; kv < KV; ++kv) for (size_t l = 0; l < NL; ++l) for (size_t b = 0; b < nblk; ++b, ++k) {
    char* dp = dev + ((kv * NL + l) * pool + blocks[b]) * piece;
    char* hp = host + ((kv * NL + l) * nblk + b) * piece;
    d2h_src[k] = dp; d2h_dst[k] = hp; h2d_src[k] = hp; h2d_dst[k] = dp;
  }
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  cudaMemcpyAttributes attr = {}; attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream; attr.flags = 0;
  size_t idx0 = 0;
  auto timeit = [&](int which, float* host_us) -> float {
    std::vector<float> ts;
    for (int r = 0; r < reps; ++r) {
      cudaEventRecord(a, s);
      auto h0 = std::chrono::steady_clock::now();
      if (which == 0) cudaMemcpyAsync(host, dev, total, cudaMemcpyDeviceToHost, s);
      else if (which == 1) cudaMemcpyAsync(dev, host, total, cudaMemcpyHostToDevice, s);
      else if (which == 2) cudaMemcpyBatchAsync(d2h_dst.data(), d2h_src.data(), sizes.data(), n, &attr, &idx0, 1, s);
      else if (which == 3) cudaMemcpyBatchAsync(h2d_dst.data(), h2d_src.data(), sizes.data(), n, &attr, &idx0, 1, s);
      else if (which == 4) for (size_t i = 0; i < n; ++i) cudaMemcpyAsync(d2h_dst[i], d2h_src[i], piece, cudaMemcpyDeviceToHost, s);
      else if (which == 5) for (size_t i = 0; i < n; ++i) cudaMemcpyAsync(h2d_dst[i], h2d_src[i], piece, cudaMemcpyHostToDevice, s);
      auto h1 = std::chrono::steady_clock::now();
      cudaEventRecord(b, s); cudaEventSynchronize(b);
      float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms);
      if (host_us) *host_us = std::chrono::duration<float, std::micro>(h1 - h0).count();
    }
    cudaError_t e = cudaGetLastError(); if (e != cudaSuccess) printf("  err which=%d: %s\n", which, cudaGetErrorString(e));
    return median(ts);
  };
  const char* names[] = {"copy_ D2H", "copy_ H2D", "batch D2H", "batch H2D", "loop D2H", "loop H2D"};
  float base[2];
  for (int w = 0; w < 6; ++w) {
    if (w >= 4 && n > 40000) continue;
    float hu = 0; float ms = timeit(w, &hu);
    float gbs = total / (ms * 1e6);
    if (w < 2) base[w] = gbs;
    printf("{\"piece\": %zu, \"T\": %zu, \"BS\": %zu, \"pieces\": %zu, \"MB\": %.1f, \"case\": \"%s\", \"ms\": %.3f, \"GBs\": %.2f, \"vs_copy\": %.4f, \"host_us\": %.1f}\n",
           piece, T, BS, n, total / 1e6, names[w], ms, gbs, gbs / base[w % 2], hu);
  }
  // correctness of the batch: D2H then compare one piece
  cudaMemset(dev, 0, KV * NL * pool * piece);
  std::vector<char> pat(piece); for (size_t i = 0; i < piece; ++i) pat[i] = (char)(i * 7 + 3);
  cudaMemcpy((void*)d2h_src[n / 2], pat.data(), piece, cudaMemcpyHostToDevice);
  cudaMemcpyBatchAsync(d2h_dst.data(), d2h_src.data(), sizes.data(), n, &attr, &idx0, 1, s); cudaStreamSynchronize(s);
  bool ok = std::equal(pat.begin(), pat.end(), (char*)d2h_dst[n / 2]);
  printf("{\"check\": %s}\n", ok ? "true" : "false");
  cudaFree(dev); cudaFreeHost(host);
  return 0;
}
int main() {
  // Llama-3-8B: NH 8, HS 128, bf16 -> 2 KiB per token per (layer, K/V)
  for (size_t BS : {16, 64, 256}) for (size_t T : {256, 8192}) run(BS * 2048, T, BS, 7);
  return 0;
}
