/* The ``routerfast`` module: the router's C tables and decider (declarations: routerfast.h). */
#include "routerfast.h"

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "routerfast", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_routerfast(void) {
    PyTypeObject *types[] = {&BlockTableType, &InFlightTableType, &DeciderType};
    const char *names[] = {"BlockTable", "InFlightTable", "Decider"};
    for (int i = 0; i < 3; i++) if (PyType_Ready(types[i]) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    for (int i = 0; i < 3; i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) { Py_DECREF(types[i]); Py_DECREF(m); return NULL; }
    }
    return m;
}
