/* Decider: the router's per-worker load and one whole routing decision in C (decider.c: state,
 * decide.c: the decision). */
#ifndef ROUTERFAST_DECIDER_H
#define ROUTERFAST_DECIDER_H
#include "records.h"

enum { PREFILL = 0, DECODE = 1 };
/* CostWeights, in this order */
enum { W_UNCACHED, W_QUEUED, W_RUNNING, W_KV, W_TRANSFER, W_HOST, W_DISK, W_IN_FLIGHT, W_BUSY_POOL, W_MIN_HIT_SHARE,
       N_WEIGHTS };

typedef struct {
    PyObject *id;                          /* worker id; NULL: removed */
    long long queued, running, waiting;    /* as last reported */
    double kv;
    long long pend_tokens, pend_running;   /* optimistic additions since (Router._Slot) */
    long long assigned;                    /* prompt tokens routed here to compute, ever (the tie-break) */
    double until; int has_until;
    int32_t flight;                        /* the in-flight table's number for it, -1: none */
    uint64_t stamp;                        /* == the decider's: m holds this decision's match */
    Match m;
} WSlot;

typedef struct {
    PyObject_HEAD
    BlockTable *blocks;
    InFlightTable *flight;                 /* NULL: in-flight tracking off */
    PyObject *epochs;                      /* InFlightPrefixes' number -> epoch list (with flight) */
    double w[N_WEIGHTS], hit_ratio, pending_ttl, flight_ttl, next_expiry;
    long long threshold;
    int colocated, has_next;
    WSlot *slots; Py_ssize_t nslots, cap;
    int32_t bit_slot[LANE];                /* index bit -> slot, -1: none */
    int32_t *flight_slot; Py_ssize_t nflight;   /* in-flight number -> slot, -1: none */
    int32_t *role[2]; Py_ssize_t nrole[2];      /* live slots by role, in the view's order */
    uint64_t stamp;
    Records rec;
} Decider;

static inline long long eff_queued(const WSlot *s) { return s->queued + s->pend_tokens; }
static inline long long eff_running(const WSlot *s) { return s->running + s->pend_running; }

PyObject *decider_decide(Decider *d, PyObject *const *args, Py_ssize_t nargs);
#endif
