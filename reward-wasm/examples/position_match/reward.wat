;; Position match: the share of positions where the completion (without surrounding whitespace)
;; agrees with the string metadata.answer, over the longer of the two: 1.0 for an exact match,
;; partial credit otherwise. Reports no details. A shaping reward for the RL demo
;; (configs/rl_digits.toml), next to exact_match. Core-module ABI v1.
(module
  (memory (export "memory") 1)
  (data (i32.const 16) "{}")
  (data (i32.const 80) "\22answer\22")            ;; 8 bytes
  (global $ans_start (mut i32) (i32.const 0))

  ;; Allocation: fresh pages at the end of memory (each call runs in a fresh instance).
  (func (export "alloc") (param $len i32) (result i32)
    (local $old i32)
    (local.set $old
      (memory.grow (i32.shr_u (i32.add (local.get $len) (i32.const 65535)) (i32.const 16))))
    (if (i32.lt_s (local.get $old) (i32.const 0)) (then unreachable))
    (i32.shl (local.get $old) (i32.const 16)))

  (func $at (param $p i32) (param $i i32) (result i32)
    (i32.load8_u (i32.add (local.get $p) (local.get $i))))

  (func $digit (param $c i32) (result i32)
    (i32.lt_u (i32.sub (local.get $c) (i32.const 48)) (i32.const 10)))

  (func $ws (param $c i32) (result i32)
    (i32.or
      (i32.or (i32.eq (local.get $c) (i32.const 32)) (i32.eq (local.get $c) (i32.const 9)))
      (i32.or (i32.eq (local.get $c) (i32.const 10)) (i32.eq (local.get $c) (i32.const 13)))))

  (func $skip_ws (param $p i32) (param $n i32) (param $i i32) (result i32)
    (block $end
      (loop $l
        (br_if $end (i32.ge_s (local.get $i) (local.get $n)))
        (br_if $end (i32.eqz (call $ws (call $at (local.get $p) (local.get $i)))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $l)))
    (local.get $i))

  ;; The index of the needle [q, q+m) in [p, p+n), or -1.
  (func $find (param $p i32) (param $n i32) (param $q i32) (param $m i32) (result i32)
    (local $i i32) (local $j i32)
    (block $none
      (loop $outer
        (br_if $none (i32.gt_s (i32.add (local.get $i) (local.get $m)) (local.get $n)))
        (local.set $j (i32.const 0))
        (block $mismatch
          (loop $inner
            (if (i32.ge_s (local.get $j) (local.get $m)) (then (return (local.get $i))))
            (br_if $mismatch
              (i32.ne (call $at (local.get $p) (i32.add (local.get $i) (local.get $j)))
                      (call $at (local.get $q) (local.get $j))))
            (local.set $j (i32.add (local.get $j) (i32.const 1)))
            (br $inner)))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $outer)))
    (i32.const -1))

  ;; The length of the top-level "answer" value in the JSON [p, p+n) (offset in $ans_start),
  ;; or -1.
  (func $answer_field (param $p i32) (param $n i32) (result i32)
    (local $i i32) (local $b i32) (local $c i32)
    (local.set $i (call $find (local.get $p) (local.get $n) (i32.const 80) (i32.const 8)))
    (if (i32.lt_s (local.get $i) (i32.const 0)) (then (return (i32.const -1))))
    (local.set $i (call $skip_ws (local.get $p) (local.get $n) (i32.add (local.get $i) (i32.const 8))))
    (if (i32.ge_s (local.get $i) (local.get $n)) (then (return (i32.const -1))))
    (if (i32.ne (call $at (local.get $p) (local.get $i)) (i32.const 58))
      (then (return (i32.const -1))))
    (local.set $i (call $skip_ws (local.get $p) (local.get $n) (i32.add (local.get $i) (i32.const 1))))
    (if (i32.lt_s (local.get $i) (local.get $n))
      (then
        (if (i32.eq (call $at (local.get $p) (local.get $i)) (i32.const 34))
          (then
            (local.set $b (i32.add (local.get $i) (i32.const 1)))
            (local.set $i (local.get $b))
            (block $end
              (loop $l
                (if (i32.ge_s (local.get $i) (local.get $n)) (then (return (i32.const -1))))
                (br_if $end (i32.eq (call $at (local.get $p) (local.get $i)) (i32.const 34)))
                (local.set $i (i32.add (local.get $i) (i32.const 1)))
                (br $l)))
            (global.set $ans_start (local.get $b))
            (return (i32.sub (local.get $i) (local.get $b)))))))
    (local.set $b (local.get $i))
    (block $end2
      (loop $l2
        (br_if $end2 (i32.ge_s (local.get $i) (local.get $n)))
        (local.set $c (call $at (local.get $p) (local.get $i)))
        (br_if $end2 (call $ws (local.get $c)))
        (br_if $end2 (i32.eq (local.get $c) (i32.const 44)))
        (br_if $end2 (i32.eq (local.get $c) (i32.const 125)))
        (br_if $end2 (i32.eq (local.get $c) (i32.const 93)))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $l2)))
    (if (i32.eq (local.get $i) (local.get $b)) (then (return (i32.const -1))))
    (global.set $ans_start (local.get $b))
    (i32.sub (local.get $i) (local.get $b)))

  ;; score = (matching positions) / max(answer length, trimmed completion length).
  (func (export "score")
    (param $pp i32) (param $pl i32) (param $cp i32) (param $cl i32) (param $mp i32) (param $ml i32)
    (result f64)
    (local $b i32) (local $e i32) (local $al i32) (local $tl i32) (local $k i32) (local $hits i32)
    (local.set $b (call $skip_ws (local.get $cp) (local.get $cl) (i32.const 0)))
    (local.set $e (local.get $cl))
    (block $stop
      (loop $back
        (br_if $stop (i32.le_s (local.get $e) (local.get $b)))
        (br_if $stop (i32.eqz (call $ws (call $at (local.get $cp) (i32.sub (local.get $e) (i32.const 1))))))
        (local.set $e (i32.sub (local.get $e) (i32.const 1)))
        (br $back)))
    (local.set $tl (i32.sub (local.get $e) (local.get $b)))
    (local.set $al (call $answer_field (local.get $mp) (local.get $ml)))
    (if (i32.le_s (local.get $al) (i32.const 0)) (then (return (f64.const 0))))
    (block $done
      (loop $cmp
        (br_if $done (i32.ge_s (local.get $k) (local.get $al)))
        (br_if $done (i32.ge_s (local.get $k) (local.get $tl)))
        (if (i32.eq (call $at (local.get $cp) (i32.add (local.get $b) (local.get $k)))
                    (call $at (local.get $mp) (i32.add (global.get $ans_start) (local.get $k))))
          (then (local.set $hits (i32.add (local.get $hits) (i32.const 1)))))
        (local.set $k (i32.add (local.get $k) (i32.const 1)))
        (br $cmp)))
    (f64.div (f64.convert_i32_s (local.get $hits))
             (f64.convert_i32_s (select (local.get $al) (local.get $tl)
                                        (i32.gt_s (local.get $al) (local.get $tl))))))

  (func (export "details_ptr") (result i32) (i32.const 16))
  (func (export "details_len") (result i32) (i32.const 2))
  (func (export "anneal_reward_abi") (result i32) (i32.const 1)))
