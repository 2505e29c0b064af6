/* A table's next, bigger slot array made ready off the routing thread (see routerfast.h, Prep).
 *
 * Growing a table in the call that fills it stalled that call for the whole first touch of the
 * new array: on this host's VM a fresh 2 MiB page costs up to ~6 ms of kernel time (a 96 MB
 * array 55-280 ms), against 3-8 ms of user time for the rehash itself. So once a table is
 * half-way to its next doubling, the array it will double into is allocated here (the caller
 * holds the GIL) and a short-lived thread asks for huge pages and writes every slot's empty
 * marker, faulting the pages in, while the router goes on; the doubling then only rehashes. The
 * thread touches nothing but that array and calls no Python API. */
#include "routerfast.h"

static void *prep_run(void *arg) {
    Prep *p = arg;
    want_huge_pages(p->mem, p->bytes);
    p->init(p->mem, p->bytes);
    return NULL;
}

int prep_start(Prep *p, size_t bytes, void (*init)(void *, size_t)) {
    if (p->mem) return 0;
    p->mem = PyMem_RawMalloc(bytes);
    if (!p->mem) return 0;                       /* no memory now: the doubling allocates as before */
    p->bytes = bytes; p->init = init;
    p->running = pthread_create(&p->thread, NULL, prep_run, p) == 0;
    if (!p->running) prep_run(p);                /* no thread: made ready here, still before it is needed */
    return 0;
}

void *prep_take(Prep *p, size_t bytes) {
    if (!p->mem || p->bytes != bytes) return NULL;
    if (p->running) { pthread_join(p->thread, NULL); p->running = 0; }
    void *mem = p->mem;
    p->mem = NULL; p->bytes = 0;
    return mem;
}

void prep_drop(Prep *p) {
    void *mem = prep_take(p, p->bytes);
    PyMem_RawFree(mem);
}
