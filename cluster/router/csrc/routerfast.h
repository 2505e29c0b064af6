/* Shared declarations of the router's C module (cluster/router/native.py compiles every .c here
 * into one extension, ``routerfast``):
 *
 *   blocktable.c  BlockTable: block hash -> PrefixIndex._held's three 64-bit lanes, walked per prompt
 *   inflight.c    InFlightTable: InFlightPrefixes' two generations (hash -> worker, epoch, expiry),
 *                 the current one doubled by a helper thread while the router goes on
 *   prepare.c     Prep: a table's next slot array faulted in by a helper thread before it is needed
 *   decider.c     Decider: one routing decision (prefix_aware, temperature 0) in one call
 *   records.c     the decision's frozen records (RoutingDecision, CostInputs, ...) built in C
 *   routerfast.c  the module
 *
 * Tables: linear probing, a multiplicative mix of the key for the home slot, deletion by backward
 * shift (no tombstones). Memory comes from PyMem_Raw* so tracemalloc counts it. */
#ifndef ROUTERFAST_H
#define ROUTERFAST_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_AHEAD 16
#define MIN_BITS 10
#define LANE 64
#define PREP_MIN_BITS 15        /* tables of this many slots and more grow into a prepared array */

/* A table's Python type: its methods, len(), constructor and destructor, named by prefix. */
#define TABLE_TYPE(var, name, cls, pre) \
    static PySequenceMethods pre##_seq = {.sq_length = (lenfunc)pre##_len}; \
    PyTypeObject var = { \
        PyVarObject_HEAD_INIT(NULL, 0) \
        .tp_name = name, .tp_basicsize = sizeof(cls), .tp_flags = Py_TPFLAGS_DEFAULT, \
        .tp_new = pre##_new, .tp_dealloc = (destructor)pre##_dealloc, \
        .tp_methods = pre##_methods, .tp_as_sequence = &pre##_seq, \
    };

static inline uint64_t mix(uint64_t k) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; return k;
}

/* find / place / grow / remove for a table type T (fields slots, mask, count; pre##_alloc
 * defined) of slot type S: EMPTY(s) says whether a slot is free, CLEAR(s) frees it. */
#define OPEN_ADDRESSING(pre, T, S, EMPTY, CLEAR) \
    static S *pre##_find(const T *t, uint64_t k) { \
        uint64_t i = mix(k) & t->mask; \
        for (;;) { \
            S *s = &t->slots[i]; \
            if (EMPTY(s)) return NULL; \
            if (s->key == k) return s; \
            i = (i + 1) & t->mask; \
        } \
    } \
    static void pre##_place(T *t, const S *v) { \
        uint64_t i = mix(v->key) & t->mask; \
        while (!EMPTY(&t->slots[i])) i = (i + 1) & t->mask; \
        t->slots[i] = *v; \
        t->count++; \
    } \
    static int pre##_grow(T *t) { \
        S *old = t->slots; uint64_t cap = t->mask + 1; \
        if (pre##_alloc(t, cap * 2) < 0) return -1; \
        for (uint64_t i = 0; i < cap; i++) if (!EMPTY(&old[i])) pre##_place(t, &old[i]); \
        PyMem_RawFree(old); \
        return 0; \
    } \
    static void pre##_remove(T *t, S *s) {       /* backward shift: no tombstones */ \
        uint64_t i = (uint64_t)(s - t->slots), j = i, m = t->mask; \
        for (;;) { \
            j = (j + 1) & m; \
            if (EMPTY(&t->slots[j])) break; \
            uint64_t home = mix(t->slots[j].key) & m; \
            if (((j - home) & m) >= ((j - i) & m)) { t->slots[i] = t->slots[j]; i = j; } \
        } \
        CLEAR(&t->slots[i]); \
        t->count--; \
    }

/* A call's keys: on the stack up to 256, else on the heap (keys_free either way); ok[i] is 0
 * where items[i] is not a 64-bit unsigned int. */
typedef struct { uint64_t *keys; char *ok; Py_ssize_t n, bad; uint64_t kstack[256]; char okstack[256]; } Keys;
int keys_load(Keys *k, PyObject **items, Py_ssize_t n);
void keys_free(Keys *k);
int to_key(PyObject *h, uint64_t *out);
void want_huge_pages(void *p, size_t n);

/* ---- Prep (prepare.c): the slot array a table will grow into, made ready by a helper thread.
 * prep_start allocates ``bytes`` (GIL held) and has a thread run want_huge_pages and ``init`` over
 * them; prep_take joins it and hands over the array if it has that size (else NULL, nothing
 * waited for); prep_drop joins and frees. One array at a time: prep_start with one held is a no-op. */
typedef struct { void *mem; size_t bytes; void (*init)(void *, size_t); pthread_t thread; int running; } Prep;
int prep_start(Prep *p, size_t bytes, void (*init)(void *, size_t));
void *prep_take(Prep *p, size_t bytes);
void prep_drop(Prep *p);

/* ---- BlockTable (blocktable.c) */
typedef struct { uint64_t key, any, off, disk; } BSlot;     /* any == 0: empty */
typedef struct { PyObject_HEAD BSlot *slots; uint64_t mask; Py_ssize_t count; } BlockTable;
extern PyTypeObject BlockTableType;

/* PrefixIndex._walk's per-worker answer, by index bit: the workers holding the first block
 * (first), and for each of them its leading blocks and how many of those are on host / disk. */
typedef struct { uint64_t first; Py_ssize_t length[LANE], host[LANE], disk[LANE]; } Walk;
void bt_walk_keys(const BlockTable *t, const Keys *k, Walk *w);

/* ---- InFlightTable (inflight.c) */
typedef struct { uint64_t key; double expiry; int32_t worker; uint32_t epoch; } FSlot;   /* worker < 0: empty */
typedef struct { FSlot *slots; uint64_t mask; Py_ssize_t count; } FGen;
/* A doubling of cur off the routing thread (inflight.c): a helper thread places ``from`` (cur,
 * read-only meanwhile) into ``to``; the router's writes go to ``delta`` (a removal as a tombstone,
 * worker -2), which is laid over ``to`` when the helper is done. stop (the router's: give up) and
 * done (the helper's) are read and written atomically by both threads. */
typedef struct { FGen from, to, delta; pthread_t thread; int running, threaded, need_init, stop, done; } Doubling;
/* next: the array cur will double into, made ready once cur is a quarter full (it doubles at half);
 * fresh: the array the next generation starts in, made ready half-way through this one;
 * dbl: a doubling of cur under way (dbl.running) */
typedef struct { PyObject_HEAD FGen cur, prev; double gen_start; int has_gen; Prep next, fresh; Doubling dbl; } InFlightTable;
extern PyTypeObject InFlightTableType;

int ft_is_empty(const InFlightTable *t);
int ft_age(InFlightTable *t, double now, double ttl);            /* InFlightPrefixes._age; -1: no memory */
/* The deepest live block's (worker, depth) by binary search; worker -1: none. */
int32_t ft_match_keys(const InFlightTable *t, const Keys *k, double now, PyObject *epochs, Py_ssize_t *depth);
int ft_record_keys(InFlightTable *t, const Keys *k, int32_t worker, uint32_t epoch, double expiry);

/* ---- Decider (decider.c, records.c) */
extern PyTypeObject DeciderType;

#endif
