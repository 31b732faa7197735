"""How close jaxwap's predictions are to what XLA compiles and what this machine measures:
predicted against compiled (`fidelity`), predicted against measured steps (`measured`,
`repredict`), and where a step's time goes op by op or call by call (`op_profile`,
`call_phases`, `step_call`), beside how stable the calibration it predicts with is
(`calibration_spread`).
"""
