/* Helpers the tables share: a call's hashes as 64-bit keys, huge pages for big tables. */
#include "routerfast.h"
#ifdef __linux__
#include <sys/mman.h>
#endif

/* Ask for transparent huge pages over a big table (before its first touch): a probe then
 * costs one cache miss, not a cache miss plus a TLB miss (THP in "madvise" mode). */
void want_huge_pages(void *p, size_t n) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1), hi = ((uintptr_t)p + n) & ~(huge - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#endif
}

int to_key(PyObject *h, uint64_t *out) {
    uint64_t k = PyLong_AsUnsignedLongLong(h);
    if (k == (uint64_t)-1 && PyErr_Occurred()) return -1;
    *out = k;
    return 0;
}

void keys_free(Keys *k) {
    if (k->keys != k->kstack) PyMem_Free(k->keys);
    if (k->ok != k->okstack) PyMem_Free(k->ok);
    k->keys = k->kstack; k->ok = k->okstack;
}

int keys_load(Keys *k, PyObject **items, Py_ssize_t n) {
    k->keys = k->kstack; k->ok = k->okstack; k->n = n; k->bad = 0;
    if (n > 256) {
        k->keys = PyMem_Malloc(n * sizeof(uint64_t)); k->ok = PyMem_Malloc(n);
        if (!k->keys || !k->ok) { keys_free(k); PyErr_NoMemory(); return -1; }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        k->ok[i] = to_key(items[i], &k->keys[i]) == 0;
        if (!k->ok[i]) { PyErr_Clear(); k->bad++; }   /* not a 64-bit hash: indexed by nobody here */
    }
    return 0;
}
