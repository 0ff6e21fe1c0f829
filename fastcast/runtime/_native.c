/* fc.autocast's construction, __enter__ and __exit__ in C, for the usual call.
 *
 * The Python class in fastcast/autocast.py is the reference: its methods define what
 * autocast does, run wherever this module is not built, and run for every call this
 * module does not take (unusual arguments, a method of the class replaced by fastcast's
 * tracing ranges, fc.inspect or a test). Each step below is the same step as there, in
 * the same order; the cold paths (refusals, warnings, stateful schemes) call back into
 * the Python functions themselves, so each rule is written once.
 *
 * Why C: a Python class call with keyword arguments builds an argument tuple and a dict
 * and runs a Python __init__, and each Python method adds a frame; together they cost
 * about twice an empty context manager before any work is done. Here the class call is
 * a vectorcall (no tuple, no dict) that fills the instance's slots directly, and
 * __enter__/__exit__ are C functions bound as methods (instancemethod).
 *
 * `install` receives everything once, at import of fastcast.autocast: those are fixed
 * facts of the process (the class, the state manager's context variable, its sets).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static struct {
    PyTypeObject *cls;        /* fastcast.autocast.autocast, the reference class */
    PyTypeObject *native;     /* its subclass whose __enter__/__exit__ are below */
    PyObject *py_enter;       /* the reference methods, as the class dict holds them */
    PyObject *py_exit;
    PyObject *stack;          /* state._stack: the ContextVar holding [frame, below, token] */
    PyObject *runnable;       /* autocast._runnable: recipe types that passed the support check */
    PyObject *recipe_types;   /* autocast._recipe_types: recipe types constructors have seen */
    PyObject *state_dict;     /* the state module's globals: the two flags __exit__ reads */
    PyObject *default_recipe; /* schemes.default_recipe */
    PyObject *ran_nothing;    /* autocast._ran_nothing(below, stacklevel) */
    PyObject *levels_exited;  /* autocast._levels_exited(frame, below, ok) */
    PyObject *not_here;       /* autocast._NOT_HERE, the message of a foreign token */
    /* Where the instance slots of AutocastFrame live (from their member descriptors). */
    Py_ssize_t enabled, recipe, calibrating, group, ran;
} N;

static PyObject *S_enabled, *S_recipe, *S_calibrating, *S_group, *S_ran, *S_enter, *S_exit,
    *S_due, *S_threads, *S_check_recipe, *S_refuse_reentry, *S_exit_out_of_order;

#define SLOT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

/* A slot's value (borrowed), or NULL with AttributeError when it is unset. */
static PyObject *slot(PyObject *obj, Py_ssize_t offset, const char *name) {
    PyObject *value = SLOT(obj, offset);
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "fc.autocast: the instance has no %s", name);
    return value;
}

/* The class's version tag when its __enter__ and __exit__ were last seen to be the
 * reference methods. CPython gives a class a new tag whenever it (or a base) is modified,
 * so while the tag is unchanged one integer comparison stands for two dict look-ups. */
static unsigned int unchanged_tag;

static int class_unchanged(void) {
    unsigned int tag = N.cls->tp_version_tag;
#ifdef Py_TPFLAGS_VALID_VERSION_TAG
    if (!(N.cls->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG))
        tag = 0;
#endif
    return tag != 0 && tag == unchanged_tag;
}

/* The class's current method `name` bound to self when it is not `reference` (tracing
 * ranges, fc.inspect or a test replaced it); NULL when it is the reference (or on error,
 * with an exception set). */
static PyObject *replaced(PyObject *self, PyObject *name, PyObject *reference) {
    if (class_unchanged())
        return NULL;
    PyObject *method = PyDict_GetItemWithError(N.cls->tp_dict, name);
    if (method == reference) {
        PyObject *other = PyDict_GetItemWithError(N.cls->tp_dict, name == S_enter ? S_exit : S_enter);
        if (other == (name == S_enter ? N.py_exit : N.py_enter)) {
#ifdef Py_TPFLAGS_VALID_VERSION_TAG
            if (N.cls->tp_flags & Py_TPFLAGS_VALID_VERSION_TAG)
#endif
                unchanged_tag = N.cls->tp_version_tag;
        }
        return NULL;
    }
    if (method == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_AttributeError, name);
        return NULL;
    }
    descrgetfunc get = Py_TYPE(method)->tp_descr_get;
    return get ? get(method, self, (PyObject *)N.cls) : Py_NewRef(method);
}

/* ----------------------------------------------------------------- construction */

/* The class called in any other way: what calling it would do without this module. */
static PyObject *construct_in_python(PyObject *type, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
    PyObject *positional = PyTuple_New(nargs);
    if (positional == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++)
        PyTuple_SET_ITEM(positional, i, Py_NewRef(args[i]));
    PyObject *keywords = NULL;
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        keywords = PyDict_New();
        for (Py_ssize_t i = 0; keywords != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
            if (PyDict_SetItem(keywords, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0)
                Py_CLEAR(keywords);
        }
        if (keywords == NULL) {
            Py_DECREF(positional);
            return NULL;
        }
    }
    /* type.__call__ itself: calling the class object again would come back here. */
    PyObject *made = PyType_Type.tp_call(type, positional, keywords);
    Py_DECREF(positional);
    Py_XDECREF(keywords);
    return made;
}

/* autocast(enabled=True, *, recipe=None, calibrating=False, amax_reduction_group=None):
 * the usual call (bools, a recipe type seen before) fills the slots here; anything else
 * goes to the Python __init__, which checks it and explains what is wrong. */
static PyObject *construct(PyObject *type, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *enabled = nargs == 1 ? args[0] : Py_True;
    PyObject *recipe = Py_None, *calibrating = Py_False, *group = Py_None;
    int usual = type == (PyObject *)N.cls && nargs <= 1;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; usual && i < nkw; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (key == S_recipe)
            recipe = value;
        else if (key == S_calibrating)
            calibrating = value;
        else if (key == S_group)
            group = value;
        else if (key == S_enabled && nargs == 0)
            enabled = value;
        else /* unknown, twice, or a name not interned: Python sorts it out */
            usual = 0;
    }
    if (!usual || !PyBool_Check(enabled) || !PyBool_Check(calibrating))
        return construct_in_python(type, args, nargs, kwnames);
    PyObject *chosen = recipe == Py_None ? PyObject_CallNoArgs(N.default_recipe)
                                         : Py_NewRef(recipe);
    if (chosen == NULL)
        return NULL;
    int seen = PySet_Contains(N.recipe_types, (PyObject *)Py_TYPE(chosen));
    if (seen <= 0) {
        Py_DECREF(chosen);
        return seen < 0 ? NULL : construct_in_python(type, args, nargs, kwnames);
    }
    PyObject *self = N.native->tp_alloc(N.native, 0);
    if (self == NULL) {
        Py_DECREF(chosen);
        return NULL;
    }
    SLOT(self, N.enabled) = Py_NewRef(enabled);
    SLOT(self, N.recipe) = chosen;
    SLOT(self, N.calibrating) = Py_NewRef(calibrating);
    SLOT(self, N.group) = Py_NewRef(group);
    SLOT(self, N.ran) = Py_NewRef(Py_False);
    return self;
}

/* ----------------------------------------------------------------- __enter__ */

static PyObject *enter(PyObject *module, PyObject *self) {
    PyObject *other = replaced(self, S_enter, N.py_enter);
    if (other != NULL) {
        PyObject *result = PyObject_CallNoArgs(other);
        Py_DECREF(other);
        return result;
    }
    if (PyErr_Occurred())
        return NULL;
    PyObject *recipe = slot(self, N.recipe, "recipe");
    if (recipe == NULL)
        return NULL;
    PyObject *below; /* the stack before this level (a new reference) */
    if (PyContextVar_Get(N.stack, NULL, &below) < 0)
        return NULL;
    if (!PyList_CheckExact(below) || PyList_GET_SIZE(below) != 3) {
        Py_DECREF(below);
        PyErr_SetString(PyExc_RuntimeError, "fc.autocast: the autocast stack is corrupt");
        return NULL;
    }
    int runnable = PySet_Contains(N.runnable, (PyObject *)Py_TYPE(recipe));
    PyObject *checked = runnable != 0 ? Py_NewRef(Py_None)
                                      : PyObject_CallMethodNoArgs(self, S_check_recipe);
    if (runnable < 0 || checked == NULL) {
        Py_XDECREF(checked);
        Py_DECREF(below);
        return NULL;
    }
    Py_DECREF(checked);
    /* Nested: refuse self if it is already below (the Python method raises). */
    for (PyObject *level = below; PyList_CheckExact(level) && PyList_GET_SIZE(level) == 3;
         level = PyList_GET_ITEM(level, 1)) {
        if (PyList_GET_ITEM(level, 0) == self) {
            checked = PyObject_CallMethodOneArg(self, S_refuse_reentry, below);
            if (checked != NULL) { /* it raises; never enter twice whatever it did */
                Py_DECREF(checked);
                PyErr_SetString(PyExc_RuntimeError, "fc.autocast: already active here");
            }
            Py_DECREF(below);
            return NULL;
        }
    }
    PyObject *node = PyList_New(3); /* [self, below, token] as in state.Stack */
    if (node == NULL) {
        Py_DECREF(below);
        return NULL;
    }
    PyList_SET_ITEM(node, 0, Py_NewRef(self));
    PyList_SET_ITEM(node, 1, below);
    PyList_SET_ITEM(node, 2, Py_NewRef(Py_None));
    PyObject *token = PyContextVar_Set(N.stack, node);
    if (token == NULL || PyList_SetItem(node, 2, token) < 0) {
        Py_DECREF(node);
        return NULL;
    }
    Py_DECREF(node); /* the context holds it now */
    return Py_NewRef(self);
}

/* ----------------------------------------------------------------- __exit__ */

static PyObject *exit_(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "fc.autocast.__exit__ takes 3 arguments");
        return NULL;
    }
    PyObject *self = args[0], *exc_type = args[1];
    PyObject *other = replaced(self, S_exit, N.py_exit);
    if (other != NULL) {
        PyObject *result = PyObject_Vectorcall(other, args + 1, 3, NULL);
        Py_DECREF(other);
        return result;
    }
    if (PyErr_Occurred())
        return NULL;
    PyObject *node;
    if (PyContextVar_Get(N.stack, NULL, &node) < 0)
        return NULL;
    if (!PyList_CheckExact(node) || PyList_GET_SIZE(node) != 3 ||
        PyList_GET_ITEM(node, 0) != self) {
        /* Not the innermost level: the Python method repairs the stack and raises. */
        PyObject *repaired = PyObject_CallMethodOneArg(self, S_exit_out_of_order, node);
        Py_DECREF(node);
        if (repaired == NULL)
            return NULL;
        node = repaired;
    }
    if (PyContextVar_Reset(N.stack, PyList_GET_ITEM(node, 2)) < 0) {
        if (PyErr_ExceptionMatches(PyExc_ValueError)) { /* the token of another context */
            PyErr_Clear();
            PyErr_SetObject(PyExc_RuntimeError, N.not_here);
        }
        Py_DECREF(node);
        return NULL;
    }
    PyObject *below = Py_NewRef(PyList_GET_ITEM(node, 1));
    Py_DECREF(node);
    PyObject *result = NULL, *flag;
    PyObject *ran = slot(self, N.ran, "ran"), *enabled = slot(self, N.enabled, "enabled");
    int ran_true = ran == NULL ? -1 : PyObject_IsTrue(ran);
    if (ran_true < 0 || enabled == NULL)
        goto done;
    if (!ran_true) {
        int due = PyObject_IsTrue(enabled);
        if (due > 0) {
            flag = PyDict_GetItemWithError(N.state_dict, S_due);
            due = flag == NULL ? (PyErr_Occurred() ? -1 : 0) : PyObject_IsTrue(flag);
        }
        if (due < 0)
            goto done;
        if (due) { /* warn from the user's `with` line: one frame less than Python's */
            PyObject *warned = PyObject_CallFunction(N.ran_nothing, "Oi", below, 2);
            if (warned == NULL)
                goto done;
            Py_DECREF(warned);
        }
    } else if (PyList_CheckExact(below) && PyList_GET_ITEM(below, 1) != Py_None) {
        /* nested: what ran here ran inside the levels below too */
        if (PyObject_SetAttr(PyList_GET_ITEM(below, 0), S_ran, Py_True) < 0)
            goto done;
    }
    /* Stateful schemes (delayed scaling) decide whether this level ends the step. */
    flag = PyDict_GetItemWithError(N.state_dict, S_threads);
    int stateful = flag == NULL ? (PyErr_Occurred() ? -1 : 0) : PyObject_IsTrue(flag);
    if (stateful < 0)
        goto done;
    if (stateful) {
        PyObject *ok = exc_type == Py_None ? Py_True : Py_False;
        PyObject *done_ = PyObject_CallFunctionObjArgs(N.levels_exited, self, below, ok, NULL);
        if (done_ == NULL)
            goto done;
        Py_DECREF(done_);
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(below);
    return result;
}

/* ----------------------------------------------------------------- install */

static Py_ssize_t slot_offset(PyTypeObject *cls, const char *name) {
    PyObject *descr = PyObject_GetAttrString((PyObject *)cls, name);
    if (descr == NULL)
        return -1;
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type))
        offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    else
        PyErr_Format(PyExc_TypeError, "fc.autocast: %s is not a slot", name);
    Py_DECREF(descr);
    return offset;
}

static PyObject *install(PyObject *module, PyObject *args) {
    PyObject *cls, *native;
    if (N.cls != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fastcast.runtime._native: installed already");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!O!OOO!O!O!OOU:install", &PyType_Type, &cls, &PyType_Type,
                          &native, &N.stack, &N.default_recipe, &PySet_Type, &N.runnable,
                          &PySet_Type, &N.recipe_types, &PyDict_Type, &N.state_dict,
                          &N.ran_nothing, &N.levels_exited, &N.not_here))
        return NULL;
    N.cls = (PyTypeObject *)cls;
    N.native = (PyTypeObject *)native;
    if (!PyType_IsSubtype(N.native, N.cls) || !(N.cls->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
        N.cls = NULL;
        PyErr_SetString(PyExc_TypeError, "install(cls, native, ...): native must subclass cls");
        return NULL;
    }
    N.py_enter = PyDict_GetItemWithError(N.cls->tp_dict, S_enter);
    N.py_exit = PyDict_GetItemWithError(N.cls->tp_dict, S_exit);
    if ((N.enabled = slot_offset(N.cls, "enabled")) < 0 ||
        (N.recipe = slot_offset(N.cls, "recipe")) < 0 ||
        (N.calibrating = slot_offset(N.cls, "calibrating")) < 0 ||
        (N.group = slot_offset(N.cls, "group")) < 0 || (N.ran = slot_offset(N.cls, "ran")) < 0 ||
        N.py_enter == NULL || N.py_exit == NULL) {
        N.cls = NULL;
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "install: the class has no __enter__/__exit__");
        return NULL;
    }
    PyObject *held[] = {cls, native, N.stack, N.default_recipe, N.runnable, N.recipe_types,
                        N.state_dict, N.ran_nothing, N.levels_exited, N.py_enter,
                        N.py_exit, N.not_here};
    for (size_t i = 0; i < sizeof held / sizeof *held; i++)
        Py_INCREF(held[i]); /* for the life of the process */
    N.cls->tp_vectorcall = construct;
    Py_RETURN_NONE;
}

/* Whether calling the class takes the C construction (tests run both paths). */
static PyObject *set_fast_construction(PyObject *module, PyObject *on) {
    if (N.cls == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "fastcast.runtime._native: not installed");
        return NULL;
    }
    int enable = PyObject_IsTrue(on);
    if (enable < 0)
        return NULL;
    N.cls->tp_vectorcall = enable ? construct : NULL;
    Py_RETURN_NONE;
}

static PyObject *fast_construction(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(N.cls != NULL && N.cls->tp_vectorcall == construct);
}

static PyMethodDef functions[] = {
    {"install", install, METH_VARARGS,
     "install(cls, native, stack, default_recipe, runnable, recipe_types, state_dict, "
     "ran_nothing, levels_exited, not_here): take over cls's construction"},
    {"set_fast_construction", set_fast_construction, METH_O,
     "Turn the C construction on or off (the Python __init__ runs when off)."},
    {"fast_construction", fast_construction, METH_NOARGS,
     "Whether calling the class takes the C construction."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef enter_def = {"__enter__", (PyCFunction)enter, METH_O,
                                "fc.autocast.__enter__ (C; the Python method is the reference)"};
static PyMethodDef exit_def = {"__exit__", (PyCFunction)(void (*)(void))exit_, METH_FASTCALL,
                               "fc.autocast.__exit__ (C; the Python method is the reference)"};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "fastcast.runtime._native",
    "fc.autocast's construction, __enter__ and __exit__ in C (see _native.c).", -1, functions,
};

static int intern(PyObject **target, const char *text) {
    *target = PyUnicode_InternFromString(text);
    return *target == NULL ? -1 : 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    if (intern(&S_enabled, "enabled") || intern(&S_recipe, "recipe") ||
        intern(&S_calibrating, "calibrating") || intern(&S_group, "amax_reduction_group") ||
        intern(&S_ran, "ran") || intern(&S_enter, "__enter__") || intern(&S_exit, "__exit__") ||
        intern(&S_due, "unused_autocast_warning_due") ||
        intern(&S_threads, "stateful_threads") || intern(&S_check_recipe, "_check_recipe") ||
        intern(&S_refuse_reentry, "_refuse_reentry") ||
        intern(&S_exit_out_of_order, "_exit_out_of_order"))
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    /* Methods that bind to any instance they are looked up on (instancemethod), for the
     * subclass's class body: __enter__ = _native.enter. */
    PyObject *functions_[2] = {PyCFunction_New(&enter_def, NULL), PyCFunction_New(&exit_def, NULL)};
    const char *names[2] = {"enter", "exit"};
    for (int i = 0; i < 2; i++) {
        PyObject *method = functions_[i] ? PyInstanceMethod_New(functions_[i]) : NULL;
        Py_XDECREF(functions_[i]);
        if (method == NULL || PyModule_AddObject(module, names[i], method) < 0) {
            Py_XDECREF(method);
            Py_DECREF(module);
            return NULL;
        }
    }
    return module;
}
