/* The decision's records built in C (records.c). */
#ifndef ROUTERFAST_RECORDS_H
#define ROUTERFAST_RECORDS_H
#include "routerfast.h"

#define MAX_FIELDS 9

typedef struct { PyTypeObject *type; Py_ssize_t off[MAX_FIELDS]; int n; } Layout;
typedef struct {
    Layout decision, inputs, match, load;
    PyObject *policy, *local, *remote;     /* the policy's name, DecisionKind.LOCAL_PREFILL / REMOTE_PREFILL */
    int ready;
} Records;
typedef struct { Py_ssize_t dev, host, disk, inf; } Match;

int records_init(Records *r, PyObject *spec);
void records_clear(Records *r);
PyObject *make_record(const Layout *l, PyObject **values);
PyObject *make_match(const Records *r, const Match *m);
PyObject *make_load(const Records *r, long long queued, long long running, long long waiting, double kv);
PyObject *make_inputs(const Records *r, PyObject *worker_id, PyObject *match, PyObject *load, double cost,
                      Py_ssize_t candidates);
#endif
