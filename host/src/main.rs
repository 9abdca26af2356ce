fn main() {
    let a = mlx_rs::Array::from_slice(&[1.0f32, 2.0, 3.0], &[3]);
    let b = mlx_rs::ops::matmul(&a.reshape(&[1, 3]).unwrap(), &a.reshape(&[3, 1]).unwrap()).unwrap();
    println!("{b:?}");
}
