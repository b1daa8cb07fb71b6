/* kvrail's honest test runtime: the public RBLN runtime C API implemented on host memory.
 *
 * Built by the tests (rbln_sys::test_runtime::build) with the system C compiler and loaded
 * through rbln-sys exactly like the vendor's library. "Device" memory is host memory that
 * only this library hands out: rbln_memcpy checks that the device side of every copy lies
 * inside a live allocation of the given device and returns RBLN_INVALID otherwise, so a
 * caller that treats a device address as a host pointer (or copies past an allocation) is
 * caught. Compile with -DOMIT_<NAME> to leave a symbol out (the symbol-absent tests), and
 * with -DWITH_RDMA_ABI to add kvrail's optional rbln_rdma_* entry points (numa node only;
 * dma-buf export stays absent: no public runtime has one). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { RBLN_SUCCESS = 0, RBLN_FAILURE = 1, RBLN_INVALID = 2 };
enum { H2D = 0, D2H = 1, D2D = 2 };

#define MAX_ALLOCS 4096
struct alloc { int dev; char *base; uint64_t len; };
static struct alloc allocs[MAX_ALLOCS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static int devices(void) {
    const char *e = getenv("RBLN_TEST_DEVICES");
    return e ? atoi(e) : 2;
}

#ifndef OMIT_rbln_get_device_count
int rbln_get_device_count(int *count) {
    if (!count) return RBLN_INVALID;
    *count = devices();
    return RBLN_SUCCESS;
}
#endif

int rbln_malloc(int dev, uint64_t size, void **out) {
    if (!out || dev < 0 || dev >= devices() || size == 0) return RBLN_INVALID;
    char *p = calloc(1, size);
    if (!p) return RBLN_FAILURE;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (!allocs[i].base) {
            allocs[i] = (struct alloc){dev, p, size};
            pthread_mutex_unlock(&lock);
            *out = p;
            return RBLN_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    free(p);
    return RBLN_FAILURE;
}

int rbln_free(int dev, void *ptr) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].base == ptr && allocs[i].dev == dev) {
            allocs[i].base = NULL;
            pthread_mutex_unlock(&lock);
            free(ptr);
            return RBLN_SUCCESS;
        }
    }
    pthread_mutex_unlock(&lock);
    return RBLN_INVALID;
}

/* 1 when [p, p+len) lies inside a live allocation of dev. */
__attribute__((unused)) static int on_device(int dev, const void *p, uint64_t len) {
    const char *c = p;
    int ok = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS && !ok; i++) {
        struct alloc *a = &allocs[i];
        ok = a->base && a->dev == dev && c >= a->base && len <= a->len &&
             (uint64_t)(c - a->base) <= a->len - len;
    }
    pthread_mutex_unlock(&lock);
    return ok;
}

#ifndef OMIT_rbln_memcpy
int rbln_memcpy(int dev, void *dst, const void *src, uint64_t size, int kind) {
    if (!dst || !src) return RBLN_INVALID;
    switch (kind) {
    case H2D: if (!on_device(dev, dst, size)) return RBLN_INVALID; break;
    case D2H: if (!on_device(dev, src, size)) return RBLN_INVALID; break;
    case D2D:
        if (!on_device(dev, dst, size) || !on_device(dev, src, size)) return RBLN_INVALID;
        break;
    default: return RBLN_INVALID;
    }
    memmove(dst, src, size);
    return RBLN_SUCCESS;
}
#endif

/* Test-only: live allocations (leak checks). Not part of the RBLN API. */
int rbln_test_live_allocs(void) {
    int n = 0;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < MAX_ALLOCS; i++) n += allocs[i].base != NULL;
    pthread_mutex_unlock(&lock);
    return n;
}

#ifdef WITH_RDMA_ABI
int rbln_rdma_abi_version(void) { return 1; }
int rbln_rdma_device_numa_node(int dev, int *node) {
    if (!node || dev < 0 || dev >= devices()) return RBLN_INVALID;
    *node = dev % 2;
    return RBLN_SUCCESS;
}
#endif
